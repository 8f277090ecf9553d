"""The decoder's end of PD: a server per TP rank that receives transfers into the receive buffer.

Lives in the decoder's scheduler process (it owns the index, so a lookup never races an
arrival); the worker ranks only read the shared-memory buffers (``receive_buffer.attach``). One
thread accepts on every port; each connection gets a thread, a slot of the connection table
(``receiver_conns.py``: peers not yet authenticated hold at most half the slots, the longest-idle
connection makes room for a new one). With a key (``auth.py``) the receiver proves it first and
says nothing about itself, allocates nothing, until the sender has proven it too; every chunk's
keyed tag is checked before the transfer is indexed. With TLS (``tls.py``) each connection is
wrapped before anything is read. Every read is bounded: a handshake must complete within
``handshake_timeout_s``, a whole transfer (ALLOC to END, however its bytes trickle) within
``transfer_timeout_s`` of its start, an idle connection is closed after ``idle_timeout_s``.
Nothing is allocated for a length read off the wire before it was checked (``wire.parse_header``,
``_parse_alloc``). Failure reasons are the protocol's own, a fixed set; refusals are logged at
most once per ``WARN_EVERY_S`` per reason.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence

from . import wire
from .auth import NONCE_BYTES, ChunkTags, PDAuth, new_nonce
from .identity import PeerIdentity, mismatch_reason
from .probe import AUTH_FAILED
from .receive_buffer import ReceiveBuffer, buffer_dir, remove_stale_buffers, space_needed
from .receive_index import Claim, ReceiveIndex, TransferFacts
from .receiver_conns import BUSY, IDLE, Connection, ConnectionTable
from .tls import ServerTLS
from .transfers import FinishedTransfer, ReceiverStats, TransferChunks, parse_alloc
from .wire import Checksums, Deadline, FrameType, WireError

log = logging.getLogger(__name__)
WARN_EVERY_S = 10.0


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
        auth: PDAuth | None = None,
        tls: ServerTLS | None = None,
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
        self._table = ConnectionTable(max_connections, max_connections // 2)
        self._auth, self._tls = auth, tls
        self._warned: dict[str, float] = {}
        self._housekeeping_s = housekeeping_s
        self._buffers: list[ReceiveBuffer] = []
        self._index: ReceiveIndex | None = None
        self._ports: list[_Port] = []
        self._lock = threading.Lock()
        self._threads: dict[socket.socket, threading.Thread] = {}
        self._stopping = threading.Event()
        self._accepter: threading.Thread | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._in_flight = 0
        self._received_bytes = 0
        self._receive_s = 0.0
        self._outcomes: Counter[str] = Counter()
        self._failed: Counter[str] = Counter()
        self._finished: deque[FinishedTransfer] = deque(maxlen=4096)

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

    @property
    def buffer_paths(self) -> list[str]:
        """The buffers' files (what must not outlive this process)."""
        return [str(buffer_dir() / b.name) for b in self._buffers]

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
            conns = list(self._threads.items())
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
                connections=len(self._table),
                received_bytes=self._received_bytes,
                receive_seconds=self._receive_s,
                transfers=dict(self._outcomes),
                failed=dict(self._failed),
                expired=self._index.expired if self._index else 0,
                released=self._index.released if self._index else 0,
                duplicates=self._index.duplicates if self._index else 0,
                evicted=self._table.evicted,
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
        slot = None if self._stopping.is_set() else self._table.admit(conn)
        if slot is None:
            self._count_failure("too_many_connections")
            conn.close()
            return
        thread = threading.Thread(target=self._serve, args=(slot, port), name="kvlens-pd-conn", daemon=True)
        with self._lock:
            self._threads[conn] = thread
        thread.start()

    def _serve(self, slot: Connection, port: _Port) -> None:
        conn = slot.sock
        try:
            deadline = Deadline(self._handshake_s)
            if _closes_unheard(conn, deadline):
                return  # a reachability probe, not a failure (kvlens doctor, a TCP health check)
            if self._tls is not None:
                conn = self._wrap_tls(conn)
            trailers = self._handshake(conn, slot, port.rank, deadline)
            seq = 0
            while port.carries_data and not self._stopping.is_set():
                if not self._table.set_state(slot, IDLE):
                    return
                try:
                    kind, body = wire.recv_frame(conn, Deadline(self._idle_s), self._idle_s)
                except (wire.PeerClosed, wire.Timeout):
                    return  # an idle connection ends without a failure (evicted ones too)
                if kind is not FrameType.ALLOC:
                    raise WireError("bad_frame", f"{kind.name} where ALLOC was expected")
                if not self._table.set_state(slot, BUSY):
                    return
                self._transfer(conn, port.rank, body, trailers, seq)
                seq += 1
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
            self._table.remove(slot.sock)
            with self._lock:
                self._threads.pop(slot.sock, None)
            conn.close()
            slot.sock.close()

    def _wrap_tls(self, conn: socket.socket) -> socket.socket:
        assert self._tls is not None
        try:
            return self._tls.wrap(conn, self._handshake_s)
        except OSError as e:
            self._warn("tls_failed", "PD receiver: a TLS handshake failed: %s", e)
            raise WireError("tls_failed") from None

    def _count_failure(self, reason: str) -> None:
        if self._stopping.is_set() and reason in ("peer_closed", "timeout"):
            reason = "shutdown"
        with self._lock:
            self._failed[reason.split(":")[0]] += 1

    def _warn(self, reason: str, text: str, *args: object) -> None:
        """A refusal's warning, at most once per WARN_EVERY_S per reason (a peer cannot flood the
        log); the rest at debug level."""
        now = time.monotonic()
        with self._lock:
            loud = now - self._warned.get(reason, -WARN_EVERY_S) >= WARN_EVERY_S
            if loud:
                self._warned[reason] = now
        log.log(logging.WARNING if loud else logging.DEBUG, text, *args)

    def _reply(self, conn: socket.socket, deadline: Deadline | None = None, **body: object) -> None:
        wire.send_all(conn, [wire.control_frame(FrameType.REPLY, body)], self._transfer_s, deadline)

    def _refuse(self, conn: socket.socket, deadline: Deadline, reason: str, **body: object) -> None:
        """Count ``reason`` (before answering, so whoever reads the answer sees the count), answer
        it, and end the connection."""
        self._count_failure(reason)
        try:
            self._reply(conn, deadline, ok=False, reason=reason, **body)
        except WireError:
            pass
        raise _Counted(reason)

    def _handshake(
        self, conn: socket.socket, slot: Connection, rank: int, deadline: Deadline
    ) -> ChunkTags | Checksums:
        """The receiver's side (``wire.py``) within ``deadline``; the connection's chunk trailers.
        ``slot`` leaves the handshaking share before the peer hears it was accepted: a peer that
        heard so may act at once, and an unauthenticated newcomer must not evict it."""
        kind, body = wire.recv_frame(conn, deadline, self._handshake_s)
        if kind is not FrameType.HELLO:
            raise WireError("bad_frame", f"{kind.name} where HELLO was expected")
        hello = wire.decode_control(body)
        if type(hello.get("version")) is not int:
            raise WireError("bad_frame", "HELLO without a version")
        if hello.get("version") != wire.VERSION:
            self._warn(
                "version", "PD handshake refused on rank %d: wire version %r", rank, hello.get("version")
            )
            self._refuse(conn, deadline, mismatch_reason(["version"]), version=wire.VERSION)
        theirs_nonce = hello.get("nonce")
        if not isinstance(theirs_nonce, bytes) or len(theirs_nonce) != NONCE_BYTES:
            raise WireError("bad_frame", "HELLO without a nonce")
        mine = new_nonce()
        proof = self._auth.proof("receiver", theirs_nonce, mine) if self._auth is not None else None
        self._reply(conn, deadline, version=wire.VERSION, nonce=mine, proof=proof)
        kind, body = wire.recv_frame(conn, deadline, self._handshake_s)
        if kind is not FrameType.AUTH:
            raise WireError("bad_frame", f"{kind.name} where AUTH was expected")
        said = wire.decode_control(body)
        if self._auth is not None and not self._auth.check("sender", theirs_nonce, mine, said.get("proof")):
            self._warn(
                AUTH_FAILED, "PD handshake refused on rank %d: the sender did not prove the PD key", rank
            )
            self._refuse(conn, deadline, AUTH_FAILED)
        try:
            theirs = PeerIdentity.from_wire(said.get("identity"))
        except ValueError as e:
            raise WireError("bad_frame", str(e)) from None
        mine_id = self._identities[rank]
        differ = mine_id.differences(theirs)
        buffer = self._buffers[rank]
        facts = {
            "identity": mine_id.to_wire(),
            "capacity_bytes": buffer.capacity,
            "free_bytes": buffer.capacity - buffer.used_bytes,
        }
        if differ:
            reason = mismatch_reason(differ)
            self._warn(
                "mismatch",
                "PD handshake refused on rank %d: %s (theirs %s, ours %s)",
                rank,
                reason,
                theirs,
                mine_id,
            )
            self._refuse(conn, deadline, reason, **facts)
        self._table.set_state(slot, IDLE)  # evicted meanwhile: the serve loop ends it
        self._reply(conn, deadline, ok=True, reason=None, **facts)
        return self._auth.session(theirs_nonce, mine) if self._auth is not None else Checksums()

    def _transfer(
        self, conn: socket.socket, rank: int, body: bytes, trailers: ChunkTags | Checksums, seq: int
    ) -> None:
        deadline = Deadline(self._transfer_s)  # the whole transfer's, however its bytes trickle
        req_id, keys, lengths, tokens = parse_alloc(wire.decode_control(body))
        buffer = self._buffers[rank]
        if space_needed(lengths) > buffer.capacity:
            self._record_failure(rank, req_id, "too_large")
            self._reply(conn, deadline, ok=False, reason="too_large")
            return
        slots = buffer.allocate_all(lengths)
        if slots is None:
            self._record_failure(rank, req_id, "buffer_full")
            self._reply(conn, deadline, ok=False, reason="buffer_full")
            return
        with self._lock:
            self._in_flight += 1
        indexed = False
        chunks = TransferChunks(seq, req_id, keys, tokens, slots, trailers)
        try:
            self._reply(conn, deadline, ok=True, reason=None)
            seconds = self._receive_chunks(conn, buffer, chunks, deadline)
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
            self._reply(conn, deadline, ok=True, reason=None)
        else:
            self._warn("checksum", "PD transfer %s on rank %d: a chunk failed its check", req_id[:64], rank)
            self._record_failure(rank, req_id, "checksum")
            self._reply(conn, deadline, ok=False, reason="checksum")

    def _receive_chunks(
        self, conn: socket.socket, buffer: ReceiveBuffer, chunks: TransferChunks, deadline: Deadline
    ) -> float | None:
        """Read every chunk into its slot until END; seconds from first byte to last, or None
        when a trailer did not match (every chunk is still read, so the reply stays in step).
        Each piece of a chunk is hashed as soon as it landed (``wire.recv_checked``), and the
        chunk checked against its trailer before the next one is read."""
        slots = chunks.slots
        got = [False] * len(slots)
        first: float | None = None
        bad = False
        size = chunks.trailers.trailer_bytes
        tail = bytearray(size + wire.HEADER.size)  # a chunk's trailer and the next frame's header
        head: bytes | None = None
        while True:
            kind, body = wire.recv_frame(conn, deadline, self._transfer_s, head)
            if first is None:
                first = time.perf_counter()
            if kind is FrameType.END:
                if not all(got):
                    raise WireError("bad_frame", "END before every chunk")
                return None if bad else time.perf_counter() - first
            if kind is not FrameType.CHUNK:
                raise WireError("bad_frame", f"{kind.name} inside a transfer")
            index, length = wire.CHUNK_BODY.unpack(body)
            if index >= len(slots) or got[index] or length != slots[index].length:
                raise WireError("bad_frame", f"chunk {index} of {length} bytes not as allocated")
            check = chunks.begin(index)
            with buffer.writable(slots[index]) as view:
                wire.recv_checked(conn, view, check, deadline, self._transfer_s)
            wire.recv_into(conn, memoryview(tail), deadline, self._transfer_s)
            bad = bad or not chunks.trailers.matches(check.trailer(), bytes(tail[:size]))
            head = bytes(tail[size:])
            got[index] = True

    def _record_failure(self, rank: int, req_id: str, reason: str) -> None:
        if self._stopping.is_set() and reason in ("peer_closed", "timeout"):
            reason = "shutdown"
        with self._lock:
            self._outcomes["failed"] += 1
            self._failed[reason] += 1
            self._finished.append(FinishedTransfer(rank, req_id, False, reason, 0, 0.0))


def _closes_unheard(conn: socket.socket, deadline: Deadline) -> bool:
    """True when the peer closes (or resets) the connection before its first byte. No transfer
    does that: it is a reachability check (``kvlens doctor``, a load balancer's or Kubernetes's
    TCP probe), so it is not counted as a failure; counted, every diagnosis would show as a
    refused transfer. Looked at before TLS, which would call it ``tls_failed``. A peer silent
    past ``deadline`` is a ``Timeout``, as in the handshake."""
    conn.settimeout(deadline.left())
    try:
        return not conn.recv(1, socket.MSG_PEEK)
    except TimeoutError:
        raise wire.Timeout() from None
    except OSError:
        return True
    finally:
        conn.settimeout(None)


class _Counted(WireError):
    """A transfer's failure, already counted: the connection ends without counting it again."""
