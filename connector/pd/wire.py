"""The frames of the PD data plane, and reading them off a socket within bounds.

Every frame starts with an 8-byte header: magic ``KP``, the frame type, a zero byte and the body
length (little-endian u32). Control bodies (``HELLO``, ``ALLOC``, ``REPLY``, ``END``) are msgpack
maps of at most ``MAX_CONTROL_BYTES``; a header announcing more is refused before anything is
read or allocated. A ``CHUNK`` frame's body is fixed: the chunk's index in the transfer, its
length and the xxh3-64 of its bytes, and the bytes follow raw; the receiver reads them with
``recv_into`` straight into the slot the allocation gave that index, so the announced length must
equal the allocated one.

One connection to a decoder rank's init port carries a transfer::

    sender                                  receiver
    HELLO {identity, version}          ->
                                       <-   REPLY {ok | reason "mismatch:<fields>", identity, ...}
    ALLOC {req_id, keys, lengths, tokens} ->
                                       <-   REPLY {ok | reason "buffer_full" | "too_large"}
    CHUNK (index, length, xxh3) bytes  ->   (once per chunk, in any order)
    END {}                             ->
                                       <-   REPLY {ok | reason "checksum"}  (ok = all indexed)

and may carry further ALLOC..END transfers after it. The alloc port answers HELLO only (a probe:
identity, capacity, free bytes) and allocates nothing.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Sequence
from enum import IntEnum
from typing import Any

import msgspec

VERSION = 1
MAGIC = b"KP"
HEADER = struct.Struct("<2sBxI")
CHUNK_BODY = struct.Struct("<IQQ")  # index, length, xxh3-64
MAX_CONTROL_BYTES = 1 << 20  # an ALLOC of 100k keys fits; nothing legitimate comes near
MAX_KEY_CHARS = 256


class FrameType(IntEnum):
    HELLO = 1
    REPLY = 2
    ALLOC = 3
    CHUNK = 4
    END = 5


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


def chunk_header(index: int, length: int, digest: int) -> bytes:
    return HEADER.pack(MAGIC, FrameType.CHUNK, CHUNK_BODY.size) + CHUNK_BODY.pack(index, length, digest)


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


def recv_into(sock: socket.socket, view: memoryview, deadline: Deadline, silence_s: float) -> None:
    """Fill ``view`` from ``sock``: ``Timeout`` past the deadline or after ``silence_s`` of
    nothing, ``PeerClosed`` at end of stream."""
    got, size = 0, len(view)
    while got < size:
        sock.settimeout(min(silence_s, deadline.left()))
        try:
            n = sock.recv_into(view[got:], size - got)
        except TimeoutError:
            raise Timeout() from None
        except OSError:
            raise PeerClosed() from None
        if n == 0:
            raise PeerClosed()
        got += n


def recv_frame(sock: socket.socket, deadline: Deadline, silence_s: float) -> tuple[FrameType, bytes]:
    """One frame's type and (bounded) body; a CHUNK's raw bytes are left on the socket."""
    head = bytearray(HEADER.size)
    recv_into(sock, memoryview(head), deadline, silence_s)
    kind, length = parse_header(head)
    body = bytearray(length)
    recv_into(sock, memoryview(body), deadline, silence_s)
    return kind, bytes(body)


def send_all(sock: socket.socket, pieces: Sequence[bytes | memoryview], timeout_s: float) -> None:
    """Send the pieces in order without joining them (``sendmsg``; the caller's buffers as they
    are). ``Timeout`` or ``PeerClosed`` on failure."""
    views = [memoryview(p).cast("B") for p in pieces if len(p)]
    sock.settimeout(timeout_s)
    try:
        while views:
            sent = sock.sendmsg(views)
            while views and sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            if views and sent:
                views[0] = views[0][sent:]
    except TimeoutError:
        raise Timeout() from None
    except OSError:
        raise PeerClosed() from None
