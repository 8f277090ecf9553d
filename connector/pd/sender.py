"""The prefiller's end of PD: one sender per worker rank, on its own thread.

``send`` queues a transfer and returns at once (the batch never waits on the network); the
thread connects to the decoder rank's init port (or reuses the connection of the last transfer
there), shakes hands, asks for the whole transfer's slots at once, sends every chunk from the
caller's memoryview (``sendmsg`` of the frame header and the view: no copy), and waits for the
receiver's word that every chunk is verified and indexed. Every step is bounded
(``connect_timeout_s``, ``io_timeout_s``); a refusal (``buffer_full``, ``too_large``,
``mismatch:...``) is an outcome, never retried. ``on_done`` is called once per transfer, on the
sender's thread, after which the memoryviews are not read again.
"""

from __future__ import annotations

import logging
import queue
import select
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from . import wire
from .identity import PeerIdentity
from .probe import read_reply, refusal, shake_hands
from .wire import FrameType, WireError

log = logging.getLogger(__name__)

REASONS = (
    "buffer_full",
    "too_large",
    "mismatch",
    "unreachable",
    "timeout",
    "peer_closed",
    "checksum",
    "shutdown",
    "invalid",  # the transfer itself is malformed (a key twice, an empty record...): never sent
    "internal",  # a defect in the sender (logged)
    "queue_full",  # max_queued transfers were waiting already
)
POOLED_IDLE_S = 20.0  # below the receiver's idle timeout, so a kept connection is still served


@dataclass(frozen=True, slots=True)
class SendOutcome:
    req_id: str  # the proxy's id
    request_id: str  # the prefiller's request
    ok: bool
    reason: str | None  # one of REASONS ("mismatch:<fields>" names them)
    bytes: int  # record bytes the receiver indexed (0 unless ok)
    seconds: float  # from the start of this transfer's connection or reuse to its end
    peer: str  # host:init_port


@dataclass(frozen=True, slots=True)
class Transfer:
    req_id: str
    request_id: str
    host: str
    init_port: int
    alloc_port: int  # the receiver's probe port (not used for a transfer)
    chunks: list[tuple[str, memoryview, int]]  # (key, record bytes, tokens)
    on_done: Callable[[SendOutcome], None]


@dataclass(frozen=True, slots=True)
class SenderStats:
    queued: int
    in_flight: int
    sent_bytes: int
    send_seconds: float
    transfers: dict[str, int] = field(default_factory=dict)  # "ok" / "failed" -> count
    failed: dict[str, int] = field(default_factory=dict)  # reason (without fields) -> count
    connections_opened: int = 0


class _Refused(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class PDSender:
    def __init__(
        self,
        identity: PeerIdentity,
        connect_timeout_s: float,
        io_timeout_s: float,
        *,
        max_queued: int = 256,
    ) -> None:
        self._identity = identity
        self._connect_s = connect_timeout_s
        self._io_s = io_timeout_s
        self._max_queued = max_queued
        self._down_until: dict[tuple[str, int], float] = {}  # unreachable receivers, for a while
        self._queue: queue.SimpleQueue[Transfer | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._active: socket.socket | None = None
        self._pool: dict[tuple[str, int], tuple[socket.socket, float]] = {}
        self._queued = 0
        self._in_flight = 0
        self._sent_bytes = 0
        self._send_s = 0.0
        self._opened = 0
        self._outcomes: Counter[str] = Counter()
        self._failed: Counter[str] = Counter()
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix=f"kvlens-pd-hash-{identity.tp_rank}")
        self._thread = threading.Thread(
            target=self._loop, name=f"kvlens-pd-send-{identity.tp_rank}", daemon=True
        )
        self._thread.start()

    def send(self, transfer: Transfer) -> None:
        """Queue ``transfer``; never blocks. It ends at once, ``on_done`` called on the caller's
        thread, as ``shutdown`` after ``close`` and as ``queue_full`` when ``max_queued``
        transfers wait already (each holds its records' memory until it ends)."""
        with self._lock:
            closing = self._closing.is_set()
            full = self._queued >= self._max_queued
            if not closing and not full:
                self._queued += 1
                self._queue.put(transfer)
                return
        self._finish(transfer, False, "shutdown" if closing else "queue_full", 0, 0.0)

    def close(self, timeout_s: float = 5.0) -> None:
        """End the transfer under way (``shutdown``) and every queued one; bounded."""
        with self._lock:
            if self._closing.is_set():
                return
            self._closing.set()
            active = self._active
        self._queue.put(None)
        if active is not None:
            _shutdown(active)
        if threading.current_thread() is not self._thread:  # not from inside an on_done
            self._thread.join(timeout_s)

    def stats(self) -> SenderStats:
        with self._lock:
            return SenderStats(
                queued=self._queued,
                in_flight=self._in_flight,
                sent_bytes=self._sent_bytes,
                send_seconds=self._send_s,
                transfers=dict(self._outcomes),
                failed=dict(self._failed),
                connections_opened=self._opened,
            )

    # -- the sender's thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                transfer = self._queue.get()
                if transfer is None:
                    break
                with self._lock:
                    self._queued -= 1
                    self._in_flight += 1
                try:
                    invalid = invalid_chunks(transfer.chunks)
                    if self._closing.is_set():
                        self._finish(transfer, False, "shutdown", 0, 0.0)
                    elif invalid:
                        log.warning("PD transfer %s not sent: %s", transfer.req_id, invalid)
                        self._finish(transfer, False, "invalid", 0, 0.0)
                    elif not transfer.chunks:
                        self._finish(transfer, True, None, 0, 0.0)  # nothing to send is a success
                    else:
                        self._run(transfer)
                except Exception:  # a defect must not stop the thread, nor leave on_done uncalled
                    log.exception("PD sender failed on %s", transfer.req_id)
                    self._finish(transfer, False, "internal", 0, 0.0)
                finally:
                    with self._lock:
                        self._in_flight -= 1
        finally:
            self._hasher.shutdown(wait=True)
            for conn, _ in self._pool.values():
                conn.close()
            self._pool.clear()
            while True:
                try:
                    left = self._queue.get_nowait()
                except queue.Empty:
                    break
                if left is not None:
                    with self._lock:
                        self._queued -= 1
                    self._finish(left, False, "shutdown", 0, 0.0)

    def _run(self, t: Transfer) -> None:
        start = time.perf_counter()
        conn: socket.socket | None = None
        try:
            conn = self._connection(t.host, t.init_port)
            sizes = [memoryview(view).nbytes for _, view, _ in t.chunks]
            alloc = {
                "req_id": t.req_id,
                "keys": [key for key, _, _ in t.chunks],
                "lengths": sizes,
                "tokens": [tokens for _, _, tokens in t.chunks],
            }
            wire.send_all(conn, [wire.control_frame(FrameType.ALLOC, alloc)], self._io_s)
            self._expect_ok(conn)
            self._send_chunks(conn, [memoryview(view).cast("B") for _, view, _ in t.chunks])
            self._expect_ok(conn)
        except _Refused as e:  # the connection is still in step: keep it
            self._keep(t, conn)
            self._finish(t, False, e.reason, 0, time.perf_counter() - start)
            return
        except (WireError, OSError) as e:
            if conn is not None:
                conn.close()
            reason = e.reason if isinstance(e, WireError) else "peer_closed"
            if self._closing.is_set():
                reason = "shutdown"
            self._finish(t, False, reason, 0, time.perf_counter() - start)
            return
        except BaseException:
            if conn is not None:
                conn.close()
            raise
        finally:
            with self._lock:
                self._active = None
        self._keep(t, conn)
        self._finish(t, True, None, sum(sizes), time.perf_counter() - start)

    def _send_chunks(self, conn: socket.socket, chunks: list[memoryview]) -> None:
        """Each chunk's frame header and bytes in one ``sendmsg`` (the kernel copies the bytes
        straight from the caller's buffer) while the hashing thread computes its checksum, which
        goes out ahead of the next chunk; END after the last one."""
        trailer = b""
        check: Future[int] | None = None
        try:
            for index, data in enumerate(chunks):
                check = self._hasher.submit(wire.digest, data)
                wire.send_all(conn, [trailer, wire.chunk_header(index, data.nbytes), data], self._io_s)
                trailer = wire.chunk_trailer(check.result())
            wire.send_all(conn, [trailer, wire.control_frame(FrameType.END, {})], self._io_s)
        finally:  # the caller's buffers are not read once on_done runs
            if check is not None:
                futures.wait([check])

    def _keep(self, t: Transfer, conn: socket.socket | None) -> None:
        if conn is not None:
            if self._closing.is_set():
                conn.close()
            else:
                self._pool[(t.host, t.init_port)] = (conn, time.monotonic())

    def _connection(self, host: str, port: int) -> socket.socket:
        kept = self._pool.pop((host, port), None)
        if kept is not None:
            conn, since = kept
            readable, _, _ = select.select([conn], [], [], 0)
            if not readable and time.monotonic() - since < POOLED_IDLE_S:  # not closed by the peer
                self._set_active(conn)
                return conn
            conn.close()
        if time.monotonic() < self._down_until.get((host, port), 0.0):
            raise WireError("unreachable")  # tried moments ago: the queue behind must not wait
        try:
            conn = socket.create_connection((host, port), timeout=self._connect_s)
        except OSError as e:
            log.debug("PD receiver %s:%d unreachable: %s", host, port, e)
            self._down_until[(host, port)] = time.monotonic() + max(1.0, self._connect_s)
            raise WireError("unreachable") from None
        self._down_until.pop((host, port), None)
        with self._lock:
            self._opened += 1
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._set_active(conn)
        self._handshake(conn, f"{host}:{port}")
        return conn

    def _set_active(self, conn: socket.socket) -> None:
        with self._lock:
            self._active = conn
            closing = self._closing.is_set()
        if closing:
            raise WireError("shutdown")

    def _handshake(self, conn: socket.socket, peer: str) -> None:
        theirs, reply, differ = shake_hands(conn, self._identity, self._io_s)
        reason = refusal(reply, differ)
        if reason:
            log.warning(
                "PD receiver %s refused: %s (ours %s, theirs %s)", peer, reason, self._identity, theirs
            )
            raise WireError(reason)

    def _expect_ok(self, conn: socket.socket) -> None:
        reply = read_reply(conn, self._io_s)
        if not reply.get("ok"):
            raise _Refused(str(reply.get("reason")))

    def _finish(self, t: Transfer, ok: bool, reason: str | None, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._outcomes["ok" if ok else "failed"] += 1
            if ok:
                self._sent_bytes += nbytes
                self._send_s += seconds
            else:
                self._failed[str(reason).split(":")[0]] += 1
        outcome = SendOutcome(t.req_id, t.request_id, ok, reason, nbytes, seconds, f"{t.host}:{t.init_port}")
        try:
            t.on_done(outcome)
        except Exception:
            log.exception("PD on_done callback failed for %s", t.req_id)


def invalid_chunks(chunks: list[tuple[str, memoryview, int]]) -> str | None:
    """Why the receiver would refuse these chunks as malformed, or None."""
    keys = set()
    for key, view, tokens in chunks:
        if not isinstance(key, str) or not 0 < len(key) <= wire.MAX_KEY_CHARS:
            return f"key {key!r} is not 1..{wire.MAX_KEY_CHARS} characters"
        if key in keys:
            return f"key {key} twice"
        keys.add(key)
        try:
            nbytes = memoryview(view).cast("B").nbytes
        except (TypeError, ValueError) as e:
            return f"record of {key} is not one contiguous buffer: {e}"
        if nbytes == 0:
            return f"record of {key} is empty"
        if type(tokens) is not int or tokens < 0:
            return f"tokens of {key} is {tokens!r}"
    return None


def _shutdown(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
