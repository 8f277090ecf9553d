"""The prefillers' notifications, as LMCache's PD sends them: each prefiller rank PUSHes one
``ProxyNotif`` over ZMQ once its transfer to its decoder rank has ended. The message is msgspec
msgpack of a tagged struct, the map ``{"type": "ProxyNotif", "req_id": ...}``.

Unlike LMCache's example proxy (which waits for them forever and keeps a count for every id it
ever heard), a request here waits a bounded time, and only ids the proxy is waiting for are
counted: a late or unknown notification is dropped and counted, so nothing grows without bound.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

logger = logging.getLogger(__name__)


class ProxyNotif(msgspec.Struct, tag=True):
    """LMCache's ``ProxyNotif`` (tag ``"ProxyNotif"`` in the field ``type``)."""

    req_id: str


_decoder = msgspec.msgpack.Decoder(ProxyNotif)


def decode_notice(data: bytes) -> str | None:
    """The req_id of a ProxyNotif; None for anything else (another PD message, or garbage)."""
    try:
        return _decoder.decode(data).req_id
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def encode_notice(req_id: str) -> bytes:
    return msgspec.msgpack.encode(ProxyNotif(req_id))


def _nothing() -> None:
    pass


@dataclass(slots=True)
class _Pending:
    expected: int
    arrived: int
    done: asyncio.Event


@dataclass(frozen=True, slots=True)
class WaitResult:
    arrived: int
    expected: int
    seconds: float

    @property
    def complete(self) -> bool:
        return self.arrived >= self.expected


class NoticeBoard:
    """Requests waiting for their notifications, keyed by the proxy's req_id. ``expect`` before
    the prefill is sent (a notification may come before the prefiller's answer), ``forget``
    when the request ends, whatever happened."""

    def __init__(self, on_stray: Callable[[], None] = _nothing, on_malformed: Callable[[], None] = _nothing):
        self._pending: dict[str, _Pending] = {}
        self.stray = 0  # for no request waiting: late (after the bound), or not ours
        self.malformed = 0
        self._on_stray, self._on_malformed = on_stray, on_malformed

    def expect(self, req_id: str, ranks: int) -> None:
        self._pending[req_id] = _Pending(ranks, 0, asyncio.Event())
        if ranks <= 0:
            self._pending[req_id].done.set()

    def notice(self, req_id: str) -> None:
        pending = self._pending.get(req_id)
        if pending is None:
            self.stray += 1
            self._on_stray()
            return
        pending.arrived += 1
        if pending.arrived >= pending.expected:
            pending.done.set()

    async def wait(self, req_id: str, timeout_s: float) -> WaitResult:
        pending = self._pending[req_id]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            await asyncio.wait_for(pending.done.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        return WaitResult(pending.arrived, pending.expected, loop.time() - t0)

    def bad_message(self) -> None:
        self.malformed += 1
        self._on_malformed()

    def forget(self, req_id: str) -> None:
        self._pending.pop(req_id, None)

    @property
    def waiting(self) -> int:
        return len(self._pending)


class NoticeListener:
    """A ZMQ PULL socket bound to ``tcp://host:port`` feeding a ``NoticeBoard``."""

    def __init__(self, board: NoticeBoard, host: str, port: int) -> None:
        self.board = board
        self.address = f"tcp://{host}:{port}"
        self._task: asyncio.Task[None] | None = None
        self._socket = None
        self.error: str | None = None

    def start(self) -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._socket = self._ctx.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(self.address)  # a port in use fails here, at start-up
        self._task = asyncio.get_running_loop().create_task(self._run(), name="pd-proxy-notices")

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def _run(self) -> None:
        assert self._socket is not None
        while True:
            try:
                data = await self._socket.recv()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a closed context ends the listener
                self.error = f"{type(e).__name__}: {e}"
                logger.error("kvlens pd-proxy: the notification listener stopped: %s", self.error)
                return
            req_id = decode_notice(data)
            if req_id is None:
                self.board.bad_message()
                continue
            self.board.notice(req_id)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._socket is not None:
            self._socket.close(linger=0)
            self._ctx.term()
