"""The prefiller's end of PD: one sender per worker rank, its transfers on a few threads.

``send`` queues a transfer and returns at once (the batch never waits on the network). Transfers
wait per destination (decoder host and init port) and up to ``max_lanes`` destinations are
served at once, each by one thread at a time, so a slow or hostile decoder holds one lane, never
the transfers to the others. A lane connects (or reuses the destination's kept connection),
shakes hands (``probe.shake_hands``: with a key the receiver proves it first, and nothing leaves
for one that does not), asks for the whole transfer's slots at once, sends every chunk from the
caller's memoryview (``sendmsg`` of the frame header and the view: no copy), its trailer hashed a
piece at a time on the lane's own thread just before the piece leaves, and waits for the
receiver's word that every chunk is verified and indexed. The whole transfer, handshake
included, is bounded by ``transfer_timeout_s`` however slowly the receiver reads; connecting by
``connect_timeout_s``. A refusal (``buffer_full``, ``too_large``, ``mismatch:...``, ``auth_failed``)
is an outcome, never retried; a reason a peer sends is mapped onto a fixed set
(``probe.known_reason``). ``on_done`` is called once per transfer, on a lane's thread, after
which the memoryviews are not read again.

State a peer could grow is bounded: kept connections are closed once idle for
``POOLED_IDLE_S`` whether or not their destination comes back, at most ``MAX_POOLED`` are kept,
and the memory of unreachable destinations is pruned as it expires (at most ``MAX_DOWN``).
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from . import wire
from .auth import ChunkTags, PDAuth
from .identity import PeerIdentity
from .probe import known_reason, read_reply, refusal, shake_hands
from .tls import ClientTLS
from .wire import Checksums, Deadline, FrameType, WireError

log = logging.getLogger(__name__)

REASONS = (
    "buffer_full",
    "too_large",
    "mismatch",
    "auth_failed",  # the receiver did not prove the PD key, or refused ours
    "tls_failed",  # the TLS handshake failed (certificate, name, protocol)
    "unreachable",
    "timeout",
    "peer_closed",
    "checksum",
    "bad_frame",  # the receiver broke the protocol
    "bad_reply",  # the receiver answered a reason that is not one of the protocol's
    "shutdown",
    "invalid",  # the transfer itself is malformed (a key twice, an empty record...): never sent
    "internal",  # a defect in the sender (logged)
    "queue_full",  # max_queued transfers were waiting already
)
POOLED_IDLE_S = 20.0  # below the receiver's idle timeout, so a kept connection is still served
MAX_POOLED = 64
MAX_DOWN = 1024
SWEEP_S = 1.0
Destination = tuple[str, int]


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
    connections_kept: int = 0


class _Refused(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(slots=True)
class _Kept:
    conn: socket.socket
    trailers: ChunkTags | Checksums
    seq: int  # transfers this connection carried (numbers the next one's chunk tags)
    since: float


class PDSender:
    def __init__(
        self,
        identity: PeerIdentity,
        connect_timeout_s: float,
        io_timeout_s: float,
        *,
        transfer_timeout_s: float | None = None,
        max_queued: int = 256,
        max_lanes: int = 4,
        auth: PDAuth | None = None,
        tls: ClientTLS | None = None,
    ) -> None:
        self._identity = identity
        self._connect_s = connect_timeout_s
        self._io_s = io_timeout_s
        self._transfer_s = transfer_timeout_s if transfer_timeout_s is not None else io_timeout_s
        self._max_queued = max_queued
        self._auth, self._tls = auth, tls
        self._lock = threading.Condition()
        self._closing = False
        self._waiting: OrderedDict[Destination, deque[Transfer]] = OrderedDict()
        self._busy: set[Destination] = set()
        self._active: set[socket.socket] = set()
        self._pool: OrderedDict[Destination, _Kept] = OrderedDict()
        self._down_until: OrderedDict[Destination, float] = OrderedDict()
        self._queued = 0
        self._in_flight = 0
        self._sent_bytes = 0
        self._send_s = 0.0
        self._opened = 0
        self._swept_at = 0.0
        self._outcomes: Counter[str] = Counter()
        self._failed: Counter[str] = Counter()
        rank = identity.tp_rank
        self._lanes = [
            threading.Thread(target=self._lane, name=f"kvlens-pd-send-{rank}-{i}", daemon=True)
            for i in range(max_lanes)
        ]
        for lane in self._lanes:
            lane.start()

    def send(self, transfer: Transfer) -> None:
        """Queue ``transfer``; never blocks. It ends at once, ``on_done`` called on the caller's
        thread, as ``shutdown`` after ``close`` and as ``queue_full`` when ``max_queued``
        transfers wait already (each holds its records' memory until it ends)."""
        with self._lock:
            closing, full = self._closing, self._queued >= self._max_queued
            if not closing and not full:
                self._queued += 1
                self._waiting.setdefault((transfer.host, transfer.init_port), deque()).append(transfer)
                self._lock.notify()
                return
        self._finish(transfer, False, "shutdown" if closing else "queue_full", 0, 0.0)

    def close(self, timeout_s: float = 5.0) -> None:
        """End the transfers under way (``shutdown``) and every queued one; bounded."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            active = list(self._active)
            left = [t for queue in self._waiting.values() for t in queue]
            self._waiting.clear()
            self._queued = 0
            self._lock.notify_all()
        for conn in active:
            _shutdown(conn)
        for transfer in left:
            self._finish(transfer, False, "shutdown", 0, 0.0)
        end = time.monotonic() + timeout_s
        for lane in self._lanes:
            if lane is not threading.current_thread():  # not from inside an on_done
                lane.join(max(0.0, end - time.monotonic()))
        with self._lock:
            kept, self._pool = list(self._pool.values()), OrderedDict()
        for k in kept:
            k.conn.close()

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
                connections_kept=len(self._pool),
            )

    @property
    def remembered_unreachable(self) -> int:
        with self._lock:
            return len(self._down_until)

    # -- the lanes --------------------------------------------------------------------------------
    def _lane(self) -> None:
        while True:
            with self._lock:
                self._sweep()
                picked = self._next()
                while picked is None and not self._closing:
                    self._lock.wait(SWEEP_S)
                    self._sweep()
                    picked = self._next()
                if picked is None:
                    return
                dest, transfer = picked
                self._busy.add(dest)
                self._queued -= 1
                self._in_flight += 1
            try:
                self._one(transfer)
            finally:
                with self._lock:
                    self._busy.discard(dest)
                    self._in_flight -= 1
                    self._lock.notify_all()

    def _next(self) -> tuple[Destination, Transfer] | None:
        """The oldest waiting destination no lane serves, and its first transfer (lock held)."""
        if self._closing:
            return None
        for dest, queue in self._waiting.items():
            if dest not in self._busy:
                transfer = queue.popleft()
                if queue:
                    self._waiting.move_to_end(dest)  # the others' turn first
                else:
                    del self._waiting[dest]
                return dest, transfer
        return None

    def _sweep(self) -> None:
        """Close kept connections idle too long; forget unreachable marks that expired (lock held;
        at most once per SWEEP_S)."""
        now = time.monotonic()
        if now < self._swept_at + SWEEP_S:
            return
        self._swept_at = now
        for dest in [d for d, k in self._pool.items() if now - k.since >= POOLED_IDLE_S]:
            self._pool.pop(dest).conn.close()
        for dest in [d for d, until in self._down_until.items() if until <= now]:
            del self._down_until[dest]

    def _one(self, transfer: Transfer) -> None:
        try:
            invalid = invalid_chunks(transfer.chunks)
            if self._closing:
                self._finish(transfer, False, "shutdown", 0, 0.0)
            elif invalid:
                log.warning("PD transfer %s not sent: %s", transfer.req_id, invalid)
                self._finish(transfer, False, "invalid", 0, 0.0)
            elif not transfer.chunks:
                self._finish(transfer, True, None, 0, 0.0)  # nothing to send is a success
            else:
                self._run(transfer)
        except Exception:  # a defect must not stop the lane, nor leave on_done uncalled
            log.exception("PD sender failed on %s", transfer.req_id)
            self._finish(transfer, False, "internal", 0, 0.0)

    def _run(self, t: Transfer) -> None:
        start = time.perf_counter()
        deadline = Deadline(self._transfer_s)
        kept: _Kept | None = None
        try:
            kept = self._connection(t.host, t.init_port, deadline)
            sizes = [memoryview(view).nbytes for _, view, _ in t.chunks]
            alloc = {
                "req_id": t.req_id,
                "keys": [key for key, _, _ in t.chunks],
                "lengths": sizes,
                "tokens": [tokens for _, _, tokens in t.chunks],
            }
            seq, kept.seq = kept.seq, kept.seq + 1
            wire.send_all(kept.conn, [wire.control_frame(FrameType.ALLOC, alloc)], self._io_s, deadline)
            self._expect_ok(kept.conn, deadline)
            self._send_chunks(kept, seq, t, deadline)
            self._expect_ok(kept.conn, deadline)
        except _Refused as e:  # the connection is still in step: keep it
            self._keep(t, kept)
            self._finish(t, False, e.reason, 0, time.perf_counter() - start)
            return
        except (WireError, OSError) as e:
            if kept is not None:
                kept.conn.close()
            reason = e.reason if isinstance(e, WireError) else "peer_closed"
            self._finish(t, False, "shutdown" if self._closing else reason, 0, time.perf_counter() - start)
            return
        except BaseException:
            if kept is not None:
                kept.conn.close()
            raise
        finally:
            if kept is not None:
                self._set_active(kept.conn, False)
        self._keep(t, kept)
        self._finish(t, True, None, sum(sizes), time.perf_counter() - start)

    def _send_chunks(self, kept: _Kept, seq: int, t: Transfer, deadline: Deadline) -> None:
        """Each chunk's frame header and bytes straight from the caller's buffer (``sendmsg``: no
        copy), its trailer hashed a piece at a time just before the piece leaves
        (``wire.send_checked``) and sent ahead of the next chunk; END after the last one. On
        return, the caller's buffers are not read again."""
        trailer = b""
        for index, (key, view, tokens) in enumerate(t.chunks):
            data = memoryview(view).cast("B")
            check = kept.trailers.begin(seq, t.req_id, key, index, tokens, data.nbytes)
            head = [trailer, wire.chunk_header(index, data.nbytes)]
            wire.send_checked(kept.conn, head, data, check, self._io_s, deadline)
            trailer = check.trailer()
        end = wire.control_frame(FrameType.END, {})
        wire.send_all(kept.conn, [trailer, end], self._io_s, deadline)

    def _keep(self, t: Transfer, kept: _Kept | None) -> None:
        if kept is None:
            return
        with self._lock:
            if self._closing:
                kept.conn.close()
                return
            kept.since = time.monotonic()
            self._pool[(t.host, t.init_port)] = kept
            while len(self._pool) > MAX_POOLED:
                self._pool.popitem(last=False)[1].conn.close()

    def _connection(self, host: str, port: int, deadline: Deadline) -> _Kept:
        with self._lock:
            kept = self._pool.pop((host, port), None)
            down = time.monotonic() < self._down_until.get((host, port), 0.0)
        if kept is not None:
            readable, _, _ = select.select([kept.conn], [], [], 0)
            if not readable and time.monotonic() - kept.since < POOLED_IDLE_S:  # not closed by the peer
                try:
                    self._set_active(kept.conn, True)
                except WireError:
                    kept.conn.close()
                    raise
                return kept
            kept.conn.close()
        if down:
            raise WireError("unreachable")  # tried moments ago: the queue behind must not wait
        try:
            conn = socket.create_connection((host, port), timeout=min(self._connect_s, deadline.left()))
        except OSError as e:
            log.debug("PD receiver %s:%d unreachable: %s", host, port, e)
            self._mark_down((host, port))
            raise WireError("unreachable") from None
        with self._lock:
            self._down_until.pop((host, port), None)
            self._opened += 1
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._set_active(conn, True)
            if self._tls is not None:
                conn = self._tls_wrap(conn, host, deadline)
            return self._handshake(conn, f"{host}:{port}", deadline)
        except BaseException:
            self._set_active(conn, False)
            conn.close()
            raise

    def _tls_wrap(self, conn: socket.socket, host: str, deadline: Deadline) -> socket.socket:
        assert self._tls is not None
        try:
            wrapped = self._tls.wrap(conn, host, min(self._io_s, deadline.left()))
        except OSError as e:
            log.warning("PD receiver %s: TLS handshake failed: %s", host, e)
            raise WireError("tls_failed") from None
        self._set_active(conn, False)
        self._set_active(wrapped, True)
        return wrapped

    def _mark_down(self, dest: Destination) -> None:
        with self._lock:
            self._down_until[dest] = time.monotonic() + max(1.0, self._connect_s)
            self._down_until.move_to_end(dest)
            while len(self._down_until) > MAX_DOWN:
                self._down_until.popitem(last=False)

    def _set_active(self, conn: socket.socket, active: bool) -> None:
        with self._lock:
            if active:
                self._active.add(conn)
            else:
                self._active.discard(conn)
            closing = self._closing
        if active and closing:
            raise WireError("shutdown")

    def _handshake(self, conn: socket.socket, peer: str, deadline: Deadline) -> _Kept:
        shake = shake_hands(conn, self._identity, min(self._io_s, deadline.left()), self._auth)
        reason = refusal(shake)
        if reason:
            log.warning(
                "PD receiver %s refused: %s (ours %s, theirs %s)", peer, reason, self._identity, shake.theirs
            )
            raise WireError(reason)
        return _Kept(conn, shake.trailers, 0, time.monotonic())

    def _expect_ok(self, conn: socket.socket, deadline: Deadline) -> None:
        reply = read_reply(conn, self._io_s, deadline)
        if not reply.get("ok"):
            raise _Refused(known_reason(reply.get("reason")))

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
