"""The decoder's end of PD: a server per TP rank that receives transfers into the receive buffer.

Lives in the decoder's scheduler process (it owns the index, so a lookup never races an
arrival); the worker ranks only read the shared-memory buffers (``receive_buffer.attach``). One
thread accepts on every port; each connection gets a thread, at most ``max_connections`` at once.
Every read is bounded: a handshake must complete within ``handshake_timeout_s``, a transfer's
frame within ``transfer_timeout_s`` of its start (so a sender gone silent or trickling frees its
slots after that), an idle connection is closed after ``idle_timeout_s``. Nothing is allocated
for a length read off the wire before it was checked (``wire.parse_header``, ``_parse_alloc``).
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from . import wire
from .identity import PeerIdentity, mismatch_reason
from .receive_buffer import ReceiveBuffer, Slot, remove_stale_buffers, space_needed
from .receive_index import Claim, ReceiveIndex, TransferFacts
from .wire import Deadline, FrameType, WireError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FinishedTransfer:
    rank: int
    req_id: str
    ok: bool
    reason: str | None
    bytes: int
    seconds: float  # first chunk byte to the last (0 when no chunk arrived)


@dataclass(frozen=True, slots=True)
class ReceiverStats:
    capacity_bytes: int  # all ranks
    used_bytes: int  # slots held: indexed records and transfers in flight
    entries: int  # indexed keys (the leak gauge: 0 when idle)
    claims: int
    in_flight: int  # transfers allocated and not yet indexed or failed
    connections: int
    received_bytes: int  # bytes of transfers indexed
    receive_seconds: float  # their first byte to last, summed
    transfers: dict[str, int] = field(default_factory=dict)  # outcome ("ok", "failed") -> count
    failed: dict[str, int] = field(default_factory=dict)  # reason -> count (refusals included)
    expired: int = 0  # entries nobody claimed in time
    released: int = 0  # entries freed after their load was reported
    duplicates: int = 0  # records received again while held (freed at once)


class _Port:
    def __init__(self, rank: int, carries_data: bool, listener: socket.socket) -> None:
        self.rank, self.carries_data, self.listener = rank, carries_data, listener
        self.number = listener.getsockname()[1]


class PDReceiver:
    def __init__(
        self,
        identities: Sequence[PeerIdentity],
        host: str,
        init_ports: Sequence[int],
        alloc_ports: Sequence[int],
        buffer_bytes: int,
        transfer_timeout_s: float,
        unclaimed_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        handshake_timeout_s: float = 5.0,
        idle_timeout_s: float = 60.0,
        max_connections: int = 64,
        housekeeping_s: float = 1.0,
    ) -> None:
        if not (len(identities) == len(init_ports) == len(alloc_ports)) or not identities:
            raise ValueError("PDReceiver needs one identity, init port and alloc port per rank")
        self._identities = list(identities)
        self._host = host
        self._wanted = (list(init_ports), list(alloc_ports))
        self._buffer_bytes = buffer_bytes
        self._transfer_s = transfer_timeout_s
        self._unclaimed_s = unclaimed_timeout_s
        self._clock = clock
        self._handshake_s = handshake_timeout_s
        self._idle_s = idle_timeout_s
        self._max_connections = max_connections
        self._housekeeping_s = housekeeping_s
        self._buffers: list[ReceiveBuffer] = []
        self._index: ReceiveIndex | None = None
        self._ports: list[_Port] = []
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._stopping = threading.Event()
        self._accepter: threading.Thread | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._in_flight = 0
        self._received_bytes = 0
        self._receive_s = 0.0
        self._outcomes: Counter[str] = Counter()
        self._failed: Counter[str] = Counter()
        self._finished: deque[FinishedTransfer] = deque(maxlen=4096)
        self._checker = ThreadPoolExecutor(1, thread_name_prefix="kvlens-pd-check")

    # -- life cycle ---------------------------------------------------------------------------
    def start(self) -> None:
        remove_stale_buffers()
        try:
            self._buffers = [ReceiveBuffer(self._buffer_bytes, r) for r in range(len(self._identities))]
            self._index = ReceiveIndex(self._buffers, self._unclaimed_s, self._clock)
            for carries_data, ports in ((True, self._wanted[0]), (False, self._wanted[1])):
                for rank, port in enumerate(ports):
                    family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
                    listener = socket.create_server((self._host, port), family=family, backlog=128)
                    self._ports.append(_Port(rank, carries_data, listener))
        except BaseException:
            self._release_resources()
            raise
        self._accepter = threading.Thread(target=self._accept_loop, name="kvlens-pd-accept", daemon=True)
        self._accepter.start()

    @property
    def init_ports(self) -> list[int]:
        return [p.number for p in self._ports if p.carries_data]

    @property
    def alloc_ports(self) -> list[int]:
        return [p.number for p in self._ports if not p.carries_data]

    @property
    def buffer_names(self) -> list[str]:
        return [b.name for b in self._buffers]

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, break every connection off (its slots are freed), free every entry and
        remove the buffers. Bounded by ``timeout_s``."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        try:
            self._wake_w.send(b"x")
        except OSError:  # start() failed and released everything already
            pass
        if self._accepter is not None:
            self._accepter.join(timeout_s)
        with self._lock:
            conns = list(self._conns.items())
        for conn, _ in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        end = time.monotonic() + timeout_s
        for _, thread in conns:
            thread.join(max(0.0, end - time.monotonic()))
        self._release_resources()

    def _release_resources(self) -> None:
        self._checker.shutdown(wait=True)
        for port in self._ports:
            port.listener.close()
        if self._index is not None:
            self._index.drop_all()
        for buffer in self._buffers:
            buffer.close()
        self._wake_r.close()
        self._wake_w.close()

    # -- what the scheduler asks ----------------------------------------------------------------
    def present(self, keys: Sequence[str]) -> int:
        return self._index.present(keys) if self._index else 0

    def claim(self, keys: Sequence[str], request_id: str) -> Claim | None:
        return self._index.claim(keys, request_id) if self._index else None

    def release(self, request_id: str) -> None:
        if self._index:
            self._index.release(request_id)

    def expire(self) -> int:
        return self._index.expire() if self._index else 0

    def take_finished(self) -> list[FinishedTransfer]:
        """Transfers ended since the last call (the newest 4,096), for histograms."""
        with self._lock:
            out = list(self._finished)
            self._finished.clear()
        return out

    def stats(self) -> ReceiverStats:
        entries, claims = self._index.counts() if self._index else (0, 0)
        with self._lock:
            return ReceiverStats(
                capacity_bytes=sum(b.capacity for b in self._buffers),
                used_bytes=sum(b.used_bytes for b in self._buffers),
                entries=entries,
                claims=claims,
                in_flight=self._in_flight,
                connections=len(self._conns),
                received_bytes=self._received_bytes,
                receive_seconds=self._receive_s,
                transfers=dict(self._outcomes),
                failed=dict(self._failed),
                expired=self._index.expired if self._index else 0,
                released=self._index.released if self._index else 0,
                duplicates=self._index.duplicates if self._index else 0,
            )

    # -- serving --------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._wake_r, selectors.EVENT_READ, None)
            for port in self._ports:
                port.listener.setblocking(False)
                sel.register(port.listener, selectors.EVENT_READ, port)
            upkeep = time.monotonic() + self._housekeeping_s
            while not self._stopping.is_set():
                ready = sel.select(timeout=self._housekeeping_s)
                if time.monotonic() >= upkeep and self._index is not None:
                    self._index.expire()  # entries nobody claims go even if nobody asks
                    upkeep = time.monotonic() + self._housekeeping_s
                for key, _ in ready:
                    if key.data is None:
                        return
                    try:
                        conn, _addr = key.fileobj.accept()  # type: ignore[union-attr]
                    except OSError:
                        continue
                    self._admit(conn, key.data)

    def _admit(self, conn: socket.socket, port: _Port) -> None:
        conn.setblocking(True)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            if len(self._conns) >= self._max_connections or self._stopping.is_set():
                self._failed["too_many_connections"] += 1
                conn.close()
                return
            thread = threading.Thread(
                target=self._serve, args=(conn, port), name="kvlens-pd-conn", daemon=True
            )
            self._conns[conn] = thread
        thread.start()

    def _serve(self, conn: socket.socket, port: _Port) -> None:
        try:
            self._handshake(conn, port.rank)
            while port.carries_data and not self._stopping.is_set():
                try:
                    kind, body = wire.recv_frame(conn, Deadline(self._idle_s), self._idle_s)
                except (wire.PeerClosed, wire.Timeout):
                    return  # an idle connection ends without a failure
                if kind is not FrameType.ALLOC:
                    raise WireError("bad_frame", f"{kind.name} where ALLOC was expected")
                self._transfer(conn, port.rank, body)
        except _Counted:
            pass
        except WireError as e:
            self._count_failure(e.reason)
        except OSError:
            self._count_failure("shutdown" if self._stopping.is_set() else "peer_closed")
        except Exception:  # a defect here must not take the receiver down: counted, logged
            log.exception("PD receiver connection on rank %d failed", port.rank)
            self._count_failure("internal")
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _count_failure(self, reason: str) -> None:
        if self._stopping.is_set() and reason in ("peer_closed", "timeout"):
            reason = "shutdown"
        with self._lock:
            self._failed[reason.split(":")[0]] += 1

    def _reply(self, conn: socket.socket, **body: object) -> None:
        wire.send_all(conn, [wire.control_frame(FrameType.REPLY, body)], self._transfer_s)

    def _handshake(self, conn: socket.socket, rank: int) -> None:
        deadline = Deadline(self._handshake_s)
        kind, body = wire.recv_frame(conn, deadline, self._handshake_s)
        if kind is not FrameType.HELLO:
            raise WireError("bad_frame", f"{kind.name} where HELLO was expected")
        mine = self._identities[rank]
        try:
            theirs = PeerIdentity.from_wire(wire.decode_control(body).get("identity"))
        except ValueError as e:
            raise WireError("bad_frame", str(e)) from None
        version = wire.decode_control(body).get("version")
        differ = mine.differences(theirs) + ([] if version == wire.VERSION else ["version"])
        buffer = self._buffers[rank]
        reason = mismatch_reason(differ) if differ else None
        if reason:  # counted and logged before the answer, so whoever reads it sees the count
            log.warning(
                "PD handshake refused on rank %d: %s (theirs %s, ours %s)", rank, reason, theirs, mine
            )
            self._count_failure(reason)
        self._reply(
            conn,
            ok=not differ,
            reason=reason,
            identity=mine.to_wire(),
            version=wire.VERSION,
            capacity_bytes=buffer.capacity,
            free_bytes=buffer.capacity - buffer.used_bytes,
        )
        if reason:
            raise _Counted(reason)

    def _transfer(self, conn: socket.socket, rank: int, body: bytes) -> None:
        req_id, keys, lengths, tokens = _parse_alloc(wire.decode_control(body))
        buffer = self._buffers[rank]
        if space_needed(lengths) > buffer.capacity:
            self._record_failure(rank, req_id, "too_large")
            self._reply(conn, ok=False, reason="too_large")
            return
        slots = buffer.allocate_all(lengths)
        if slots is None:
            self._record_failure(rank, req_id, "buffer_full")
            self._reply(conn, ok=False, reason="buffer_full")
            return
        with self._lock:
            self._in_flight += 1
        indexed = False
        try:
            self._reply(conn, ok=True, reason=None)
            seconds = self._receive_chunks(conn, buffer, slots)
            if seconds is not None:
                total = sum(lengths)
                facts = TransferFacts(req_id, total, seconds * 1000.0, self._index.clock())
                self._index.add(rank, keys, tokens, slots, facts)
                indexed = True
        except WireError as e:
            self._record_failure(rank, req_id, e.reason)
            raise _Counted(e.reason) from None
        finally:
            if not indexed:
                for slot in slots:
                    buffer.free(slot)
            with self._lock:
                self._in_flight -= 1
        if indexed:
            with self._lock:
                self._received_bytes += total
                self._receive_s += seconds
                self._outcomes["ok"] += 1
                self._finished.append(FinishedTransfer(rank, req_id, True, None, total, seconds))
            self._reply(conn, ok=True, reason=None)
        else:
            self._record_failure(rank, req_id, "checksum")
            self._reply(conn, ok=False, reason="checksum")

    def _receive_chunks(self, conn: socket.socket, buffer: ReceiveBuffer, slots: list[Slot]) -> float | None:
        """Read every chunk into its slot until END; seconds from first byte to last, or None
        when a checksum did not match (every chunk is still read, so the reply stays in step).
        Each chunk is checked on the checker thread while the next one is read."""
        got = [False] * len(slots)
        first: float | None = None
        checks: list[tuple[Future[int], int]] = []
        views: list[memoryview] = []
        try:
            while True:
                deadline = Deadline(self._transfer_s)
                kind, body = wire.recv_frame(conn, deadline, self._transfer_s)
                if first is None:
                    first = time.perf_counter()
                if kind is FrameType.END:
                    if not all(got):
                        raise WireError("bad_frame", "END before every chunk")
                    bad = any(check.result() != expected for check, expected in checks)
                    return None if bad else time.perf_counter() - first
                if kind is not FrameType.CHUNK:
                    raise WireError("bad_frame", f"{kind.name} inside a transfer")
                index, length = wire.CHUNK_BODY.unpack(body)
                if index >= len(slots) or got[index] or length != slots[index].length:
                    raise WireError("bad_frame", f"chunk {index} of {length} bytes not as allocated")
                view = buffer.writable(slots[index])
                views.append(view)
                trailer = bytearray(wire.DIGEST.size)
                wire.recv_into(conn, view, deadline, self._transfer_s)
                wire.recv_into(conn, memoryview(trailer), deadline, self._transfer_s)
                checks.append((self._checker.submit(wire.digest, view), wire.DIGEST.unpack(trailer)[0]))
                got[index] = True
        finally:  # no check still reads a slot once this returns (the slots may be freed next)
            futures.wait([check for check, _ in checks])
            for view in views:
                view.release()

    def _record_failure(self, rank: int, req_id: str, reason: str) -> None:
        if self._stopping.is_set() and reason in ("peer_closed", "timeout"):
            reason = "shutdown"
        with self._lock:
            self._outcomes["failed"] += 1
            self._failed[reason] += 1
            self._finished.append(FinishedTransfer(rank, req_id, False, reason, 0, 0.0))


class _Counted(WireError):
    """A transfer's failure, already counted: the connection ends without counting it again."""


def _parse_alloc(body: dict) -> tuple[str, list[str], list[int], list[int]]:
    req_id, keys, lengths, tokens = (body.get(k) for k in ("req_id", "keys", "lengths", "tokens"))
    ok = (
        isinstance(req_id, str)
        and len(req_id) <= wire.MAX_KEY_CHARS
        and isinstance(keys, list)
        and isinstance(lengths, list)
        and isinstance(tokens, list)
        and 0 < len(keys) == len(lengths) == len(tokens)
        and all(isinstance(k, str) and 0 < len(k) <= wire.MAX_KEY_CHARS for k in keys)
        and all(type(n) is int and 0 < n < 2**40 for n in lengths)
        and all(type(n) is int and 0 <= n < 2**31 for n in tokens)
        and len(set(keys)) == len(keys)
    )
    if not ok:
        raise WireError("bad_frame", "malformed ALLOC")
    return req_id, keys, lengths, tokens
