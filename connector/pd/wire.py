"""The frames of the PD data plane, and reading and writing them within bounds.

Every frame starts with an 8-byte header: magic ``KP``, the frame type, a zero byte and the body
length (little-endian u32). Control bodies (``HELLO``, ``AUTH``, ``ALLOC``, ``REPLY``, ``END``)
are msgpack maps of at most ``MAX_CONTROL_BYTES``; a header announcing more is refused before
anything is read or allocated. A ``CHUNK`` frame's body is fixed: the chunk's index in the
transfer and its length; the bytes follow raw, then their trailer: the xxh3-64 (8 bytes) without
a key, an AES-GCM tag (16 bytes, ``auth.py``) with one. The receiver reads the bytes with
``recv_into`` straight into the slot the allocation gave that index (so the announced length must
equal the allocated one). The trailer follows the bytes so that each end hashes a chunk a piece
at a time as the piece passes (``send_checked``, ``recv_checked``), while it is in the cache.

One connection to a decoder rank's init port carries a transfer::

    sender                                  receiver
    HELLO {version, nonce}             ->
                                       <-   REPLY {version, nonce, proof | nil}
    AUTH {identity, proof | nil}       ->   (a sender with a key checked the receiver's proof)
                                       <-   REPLY {ok | reason "mismatch:<fields>" | "auth_failed",
                                                   identity, capacity_bytes, free_bytes}
    ALLOC {req_id, keys, lengths, tokens} ->
                                       <-   REPLY {ok | reason "buffer_full" | "too_large"}
    CHUNK (index, length) bytes trailer ->  (once per chunk, in any order)
    END {}                             ->
                                       <-   REPLY {ok | reason "checksum"}  (ok = all indexed)

and may carry further ALLOC..END transfers after it (each numbered, from 0, in the chunk tags).
With a key, the receiver says nothing about itself until the sender's proof checked (a refused
sender reads only ``auth_failed``). The alloc port answers the handshake only (a probe: identity,
capacity, free bytes) and allocates nothing.

A socket may be a TLS one (``ssl.SSLSocket``, ``tls.py``): it is read and written piece by piece
with Python's timeouts (TLS has neither ``sendmsg`` nor ``MSG_WAITALL``); a plain socket keeps
the kernel's timeouts and one call per piece.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time
import weakref
from collections.abc import Sequence
from enum import IntEnum
from typing import Any, Protocol

import msgspec
import xxhash

VERSION = 2
MAGIC = b"KP"
HEADER = struct.Struct("<2sBxI")
CHUNK_BODY = struct.Struct("<IQ")  # index, length; the bytes follow, then their xxh3-64
DIGEST = struct.Struct("<Q")
MAX_CONTROL_BYTES = 1 << 20  # an ALLOC of 100k keys fits; nothing legitimate comes near
MAX_KEY_CHARS = 256


class FrameType(IntEnum):
    HELLO = 1
    REPLY = 2
    ALLOC = 3
    CHUNK = 4
    END = 5
    AUTH = 6


class WireError(Exception):
    """The peer broke the protocol; ``reason`` is the counted refusal reason."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class PeerClosed(WireError):
    def __init__(self) -> None:
        super().__init__("peer_closed")


class Timeout(WireError):
    def __init__(self) -> None:
        super().__init__("timeout")


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


def control_frame(kind: FrameType, body: dict[str, Any]) -> bytes:
    payload = _encoder.encode(body)
    return HEADER.pack(MAGIC, kind, len(payload)) + payload


def chunk_header(index: int, length: int) -> bytes:
    return HEADER.pack(MAGIC, FrameType.CHUNK, CHUNK_BODY.size) + CHUNK_BODY.pack(index, length)


HASH_PIECE = 1 << 20


def digest(data: memoryview) -> int:
    """xxh3-64 of ``data``, hashed a MiB at a time: xxhash holds the GIL while it hashes, and
    the threads beside this one (vLLM's scheduler on the decoder, the forward pass on the
    prefiller) get it back between pieces instead of waiting out a whole record."""
    if data.nbytes <= HASH_PIECE:
        return xxhash.xxh3_64_intdigest(data)
    hasher = xxhash.xxh3_64()
    for start in range(0, data.nbytes, HASH_PIECE):
        hasher.update(data[start : start + HASH_PIECE])
    return hasher.intdigest()


def chunk_trailer(digest: int) -> bytes:
    return DIGEST.pack(digest)


class RunningCheck(Protocol):
    """A chunk's trailer computed piece by piece, as its bytes are sent or received."""

    def update(self, piece: memoryview) -> None: ...

    def trailer(self) -> bytes: ...


class RunningDigest:
    __slots__ = ("_hasher",)

    def __init__(self) -> None:
        self._hasher = xxhash.xxh3_64()

    def update(self, piece: memoryview) -> None:
        self._hasher.update(piece)

    def trailer(self) -> bytes:
        return DIGEST.pack(self._hasher.intdigest())


class Checksums:
    """A connection's chunk trailers without a key: xxh3-64 of the bytes (damage, not intent)."""

    trailer_bytes = DIGEST.size

    def begin(self, seq: int, req_id: str, key: str, index: int, tokens: int, nbytes: int) -> RunningCheck:
        return RunningDigest()

    def tag(self, seq: int, req_id: str, key: str, index: int, tokens: int, data: memoryview) -> bytes:
        return DIGEST.pack(digest(data))

    def matches(self, expected: bytes, given: bytes) -> bool:
        return expected == given


def parse_header(raw: bytes | memoryview) -> tuple[FrameType, int]:
    """The frame's type and body length, checked against what that type's body can be."""
    magic, kind, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise WireError("bad_frame", "bad magic")
    try:
        kind = FrameType(kind)
    except ValueError:
        raise WireError("bad_frame", f"unknown frame type {kind}") from None
    limit = CHUNK_BODY.size if kind is FrameType.CHUNK else MAX_CONTROL_BYTES
    if length > limit or (kind is FrameType.CHUNK and length != CHUNK_BODY.size):
        raise WireError("bad_frame", f"{kind.name} body of {length} bytes")
    return kind, length


def decode_control(body: bytes | memoryview) -> dict[str, Any]:
    try:
        value = _decoder.decode(body)
    except msgspec.DecodeError:
        raise WireError("bad_frame", "undecodable body") from None
    if not isinstance(value, dict):
        raise WireError("bad_frame", "body is not a map")
    return value


class Deadline:
    """Time left for one bounded step; ``None`` bound means only per-call ``idle`` silence counts."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise Timeout()
        return left


TIMEOUT_SLACK_S = 0.01  # how far a kept kernel timeout may stray from the one asked for


def _os_timeout(sock: socket.socket, option: int, seconds: float) -> None:
    """Bound each blocking call in the kernel (SO_RCVTIMEO / SO_SNDTIMEO): the socket stays in
    blocking mode, so a 4 MiB send or receive is one call, not a poll() and a call per piece as
    Python's own timeouts make it. The timeout last set is kept while it is within
    ``TIMEOUT_SLACK_S`` of the one asked for (one bounded by a deadline shrinks as time passes):
    a ``setsockopt`` takes the socket's lock, which the sender's own acknowledgements contend
    for, and set before every piece it cost a tenth of the send."""
    kept = _timeouts.get(sock)
    if kept is None:
        kept = _timeouts.setdefault(sock, {})
    last = kept.get(option)
    if last is not None and abs(last - seconds) <= TIMEOUT_SLACK_S:
        return
    if sock.gettimeout() is not None:  # settimeout costs two fcntl calls even when nothing changes
        sock.settimeout(None)
    whole = int(seconds)
    micros = int((seconds - whole) * 1e6)
    if whole == 0 and micros == 0:
        micros = 1  # a zero timeval means "no timeout"
    sock.setsockopt(socket.SOL_SOCKET, option, _TIMEVAL.pack(whole, micros))
    kept[option] = seconds


_timeouts: weakref.WeakKeyDictionary[socket.socket, dict[int, float]] = weakref.WeakKeyDictionary()
_TIMEVAL = struct.Struct("@ll")


def recv_into(sock: socket.socket, view: memoryview, deadline: Deadline, silence_s: float) -> None:
    """Fill ``view`` from ``sock`` (one ``MSG_WAITALL`` read on a plain socket, more only if it
    is cut short): ``Timeout`` when ``silence_s`` passes within a read or once past the deadline,
    ``PeerClosed`` at end of stream."""
    got, size = 0, len(view)
    tls = isinstance(sock, ssl.SSLSocket)
    if not tls:
        _os_timeout(sock, socket.SO_RCVTIMEO, min(silence_s, deadline.left()))
    while got < size:
        try:
            if tls:
                sock.settimeout(min(silence_s, deadline.left()))
                n = sock.recv_into(view[got:], size - got)
            else:
                n = sock.recv_into(view[got:], size - got, socket.MSG_WAITALL)  # one wake-up
        except (BlockingIOError, TimeoutError):
            raise Timeout() from None
        except OSError:
            raise PeerClosed() from None
        if n == 0:
            raise PeerClosed()
        got += n
        if got < size and not tls:
            _os_timeout(sock, socket.SO_RCVTIMEO, min(silence_s, deadline.left()))


def recv_frame(
    sock: socket.socket, deadline: Deadline, silence_s: float, head: bytes | None = None
) -> tuple[FrameType, bytes]:
    """One frame's type and (bounded) body; a CHUNK's raw bytes are left on the socket. ``head``:
    the frame's header when it was read already (with the chunk trailer before it)."""
    if head is None:
        head = bytearray(HEADER.size)
        recv_into(sock, memoryview(head), deadline, silence_s)
    kind, length = parse_header(head)
    body = bytearray(length)
    recv_into(sock, memoryview(body), deadline, silence_s)
    return kind, bytes(body)


TLS_PIECE = 1 << 18  # a TLS write at a time, so that the deadline is checked between them


def send_all(
    sock: socket.socket,
    pieces: Sequence[bytes | memoryview],
    timeout_s: float,
    deadline: Deadline | None = None,
) -> None:
    """Send the pieces in order without joining them (``sendmsg``; the caller's buffers as they
    are). ``Timeout`` when the peer takes nothing for ``timeout_s`` or once past ``deadline``
    (a peer that reads a trickle cannot hold the sender longer), ``PeerClosed`` on failure."""
    views = [memoryview(p).cast("B") for p in pieces if len(p)]

    def bound() -> float:
        return timeout_s if deadline is None else min(timeout_s, deadline.left())

    try:
        if isinstance(sock, ssl.SSLSocket):
            for view in views:
                for start in range(0, view.nbytes, TLS_PIECE):
                    sock.settimeout(bound())
                    sock.sendall(view[start : start + TLS_PIECE])
            return
        while views:
            _os_timeout(sock, socket.SO_SNDTIMEO, bound())
            sent = sock.sendmsg(views)
            while views and sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            if views and sent:
                views[0] = views[0][sent:]
    except (BlockingIOError, TimeoutError):
        raise Timeout() from None
    except OSError:
        raise PeerClosed() from None


CHECK_PIECE = 1 << 20  # bytes moved, then hashed, at a time: still in the core's L2 when hashed


def send_checked(
    sock: socket.socket,
    head: Sequence[bytes],
    data: memoryview,
    check: RunningCheck,
    timeout_s: float,
    deadline: Deadline,
) -> None:
    """Send ``head`` then ``data``, ``data`` hashed into ``check`` a piece at a time just before
    the piece leaves: the kernel's copy then reads bytes the hash brought into the cache, and no
    other thread (nor a hand-off to one per chunk) is needed."""
    pieces: list[bytes | memoryview] = list(head)
    step = _piece_bytes(data.nbytes)
    for start in range(0, data.nbytes, step):
        with data[start : start + step] as piece:
            check.update(piece)
            send_all(sock, [*pieces, piece], timeout_s, deadline)
        pieces = []


def recv_checked(
    sock: socket.socket, view: memoryview, check: RunningCheck, deadline: Deadline, silence_s: float
) -> None:
    """Fill ``view`` a piece at a time (``recv_into``), each piece hashed into ``check`` as soon
    as it landed, while it is still in the cache."""
    step = _piece_bytes(view.nbytes)
    for start in range(0, view.nbytes, step):
        with view[start : start + step] as piece:
            recv_into(sock, piece, deadline, silence_s)
            check.update(piece)


def _piece_bytes(nbytes: int) -> int:
    """``nbytes`` in pieces of about ``CHECK_PIECE`` (a whole number of cache lines), none of
    them a small remainder: a record of 1 MiB and its header is one piece, not two."""
    pieces = max(1, round(nbytes / CHECK_PIECE))
    return -(-nbytes // pieces // 64) * 64 if pieces > 1 else nbytes
