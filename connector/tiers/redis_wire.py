"""The remote tier's two bulk commands, GET and SET, on redis-py's connections without its copies.

redis-py reads a value through its own buffers into a new ``bytes`` (hiredis too: into its reader's
buffer, then into a ``bytes``), and fresh memory costs a page fault per page: side by side with a
bare client reading into one reused buffer, 4 MiB values in batches of 8, redis-py's pipeline read
about 0.2x its bytes per second and about 0.5x with hiredis (bench/remote_tier_vs_bare.py; two
connections per batch gained nothing either). With hiredis installed redis-py also packs a SET
into one new ``bytes``, a second copy of the value.

So a batch of GETs goes out on a connection from the client's own pool (connected, authenticated,
TLS, the Sentinel's master, a Cluster node: as redis-py set it up) and each reply is read from its
socket with ``recv_into`` straight into a reused buffer (``ReadBuffers``); the value's check
(``codec.RecordCheck``) is fed each piece as it lands, so the checksum reads bytes still in the
CPU's cache. A SET is sent as the RESP frame around the caller's pieces (the record's header, then
the payload itself) with ``sendmsg``, so the payload is never copied into a record first; frames
may be made as they go out, so the next record's checksum is computed while the server reads the
one before. Only the reply types these commands have are read
here: a bulk string or nil, a status, an error (classed as redis-py classes it). Anything else, a
closed socket or a timeout breaks the connection off (it is disconnected, never reused out of
step) and fails the batch with redis-py's own ``ConnectionError``/``TimeoutError``.

Connections speaking RESP3 (``protocol=3`` in the URL, which allows pushes between replies) go
through redis-py's pipelines as before: ``fast_path`` says which. So does every connection once
one is found without a socket where this module reads it (``NoSocket``: a redis-py to come).
"""

from __future__ import annotations

import inspect
import socket
import ssl
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

from redis import Redis
from redis._parsers import BaseParser
from redis.connection import ConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse
from redis.exceptions import TimeoutError as RedisTimeoutError

from .base import ChunkCorrupt
from .read_buffers import ReadBuffers

Frame = list[bytes | memoryview]  # one command's bytes, in order

_CRLF = b"\r\n"
_LINE_READ = 4096  # bytes asked for when a reply's first line is incomplete
_MAX_LINE = 64 * 1024
_JOIN = 64 * 1024  # TLS: pieces under this are joined into one send
_SEND_AT = 256 * 1024  # frames gathered up to this many bytes go out in one sendmsg
_MAX_PIECES = 512  # pieces in one sendmsg (the kernel takes at most IOV_MAX, 1024)
# A value longer than any record is read past in pieces of this size, never into one buffer; one
# longer than Redis's default limit of a value (proto-max-bulk-len) breaks the connection off.
_SKIP_PIECE = 64 * 1024
_SKIP_MAX = 512 * 1024**2
# redis-py < 5.3 needs a command name to hand out a connection; later versions warn when given one
_NAMED = (
    inspect.signature(ConnectionPool.get_connection).parameters["command_name"].default
    is inspect.Parameter.empty
)


class NoSocket(Exception):
    """This redis-py's connections keep their socket where this module does not look for it."""


def get_frame(key: bytes) -> bytes:
    return b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (len(key), key)


def set_frame(key: bytes, header: bytes, payload: memoryview, ttl_s: int | None) -> Frame:
    """``SET key <header + payload> [EX ttl_s]``: the payload goes out as it is, uncopied."""
    argc = 3 if ttl_s is None else 5
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n%b" % (
        argc,
        len(key),
        key,
        len(header) + payload.nbytes,
        header,
    )
    tail = _CRLF if ttl_s is None else b"\r\n$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(ttl_s)), ttl_s)
    return [head, payload, tail]


def fast_path(client: Redis) -> bool:
    """Whether ``client``'s connections can be read here (RESP2 sockets, redis-py's default)."""
    pool = client.connection_pool
    protocol = pool.connection_kwargs.get("protocol") or 2
    return str(protocol) == "2" and getattr(pool, "cache", None) is None


class ValueCheck(Protocol):
    """Checks one value while it arrives (``codec.RecordCheck`` is one)."""

    def fed(self, value: memoryview, have: int) -> None:
        """``value[:have]`` is in; ``value`` is the view the whole value is read into."""

    def done(self, value: memoryview) -> Any:
        """What the caller gets for the whole ``value`` (a read-only view)."""


def get_many(
    client: Redis,
    keys: Sequence[bytes],
    buffers: ReadBuffers,
    check: Callable[[int], ValueCheck],
    max_bytes: int | None = None,
) -> list[Any]:
    """Per key: ``check(position).done(value)`` of its value (a read-only view in a reused
    buffer), None (no such key), the error reply, or ChunkCorrupt for a value over ``max_bytes``
    (read past, never into memory). Raises redis-py's ``ConnectionError``/``TimeoutError`` when
    the batch fails. Each value's check is ``fed`` every piece as it lands, while the server
    sends the next."""
    if not keys:
        return []
    with _connection(client) as (conn, replies):
        conn.send_packed_command([b"".join(get_frame(k) for k in keys)])
        out = []
        for position in range(len(keys)):
            checker = check(position)
            value = replies.bulk(buffers, max_bytes, checker)
            out.append(checker.done(value) if isinstance(value, memoryview) else value)
        return out


def set_many(client: Redis, frames: Iterable[Frame]) -> list[Any]:
    """Per frame: True (stored) or the error reply; raises like ``get_many``.

    ``frames`` may be made as they are sent (a generator): each is sent before the next one is
    made, so a record's checksum is computed while the server reads the record before it.
    """
    if isinstance(frames, Sequence) and not frames:
        return []
    with _connection(client) as (_, replies):
        count = _send_frames(replies.sock, frames)
        return [replies.status() for _ in range(count)]


@contextmanager
def _connection(client: Redis) -> Iterator[tuple[Any, _Replies]]:
    """A pooled connection and a reader of its replies; broken off if the exchange fails."""
    pool = client.connection_pool
    conn = pool.get_connection("GET") if _NAMED else pool.get_connection()
    sock = _socket_of(conn)
    if sock is None:
        pool.release(conn)
        raise NoSocket(type(conn).__name__)
    try:
        replies = _Replies(sock)
        yield conn, replies
        if replies.pending:  # bytes nobody asked for: the stream is out of step
            raise InvalidResponse(f"{len(replies.pending)} unexpected bytes after the replies")
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def _socket_of(conn: Any) -> socket.socket | None:
    """The connected socket of a pooled connection (its replies to us are ours to read)."""
    sock = getattr(conn, "_sock", None)
    return sock if isinstance(sock, socket.socket) else None


def _send_frames(sock: socket.socket, frames: Iterable[Frame]) -> int:
    """Send the frames in order (a payload is never copied); returns how many were sent.

    Pieces are gathered until ``_SEND_AT`` bytes, then go out in one ``sendmsg``: a large
    payload leaves as soon as its frame is made, small frames travel together. TLS sockets have
    no ``sendmsg``: their small pieces are joined up to ``_JOIN`` bytes and sent one by one.
    """
    send = _sendall if isinstance(sock, ssl.SSLSocket) else _sendmsg
    pending: list[bytes | memoryview] = []
    size = count = 0
    for frame in frames:
        count += 1
        for piece in frame:
            pending.append(piece)
            size += piece.nbytes if isinstance(piece, memoryview) else len(piece)
        if size >= _SEND_AT or len(pending) >= _MAX_PIECES:
            send(sock, pending)
            pending, size = [], 0
    if pending:
        send(sock, pending)
    return count


def _sendmsg(sock: socket.socket, pieces: list[bytes | memoryview]) -> None:
    views = [memoryview(p).cast("B") for p in pieces]
    first = 0
    while first < len(views):
        sent = _io(sock.sendmsg, views[first : first + _MAX_PIECES])
        while first < len(views) and sent >= views[first].nbytes:
            sent -= views[first].nbytes
            first += 1
        if sent:
            views[first] = views[first][sent:]


def _sendall(sock: socket.socket, pieces: list[bytes | memoryview]) -> None:
    for piece in _coalesced([pieces]):
        _io(sock.sendall, piece)


def _coalesced(frames: Sequence[Frame]) -> list[bytes | memoryview]:
    """The frames' pieces, neighbouring small ones joined up to ``_JOIN`` bytes (fewer sends;
    only small payloads are copied)."""
    out: list[bytes | memoryview] = []
    small: list[bytes | memoryview] = []
    joined = 0
    for frame in frames:
        for piece in frame:
            size = piece.nbytes if isinstance(piece, memoryview) else len(piece)
            if small and (size >= _JOIN or joined + size > _JOIN):
                out.append(b"".join(small))
                small, joined = [], 0
            if size >= _JOIN:
                out.append(piece)
            else:
                small.append(piece)
                joined += size
    if small:
        out.append(b"".join(small))
    return out


def _io(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on the socket, its failures as redis-py's (the batch fails, the connection
    is broken off)."""
    try:
        return fn(*args)
    except TimeoutError:
        raise RedisTimeoutError("Timeout on the socket") from None
    except OSError as e:
        raise RedisConnectionError(f"Error on the socket: {e}") from None


class _Replies:
    """Reads replies off one socket: first lines through a small buffer, values with recv_into."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pending = bytearray()  # received, not yet consumed

    def bulk(
        self, buffers: ReadBuffers, max_bytes: int | None = None, checker: ValueCheck | None = None
    ) -> memoryview | None | Exception:
        line = self._line()
        kind = line[:1]
        if kind == b"$":
            size = _int(line)
            if size < 0:
                return None
            if max_bytes is not None and size > max_bytes:
                if size > _SKIP_MAX:
                    raise InvalidResponse(f"a value of {size} bytes, more than a Redis value holds")
                self._skip(size + 2)
                return ChunkCorrupt(f"a value of {size} bytes, larger than any chunk record")
            view = buffers.take(size + 2)
            self._fill(view[: size + 2], size, checker)
            if view[size : size + 2] != _CRLF:
                raise InvalidResponse("a value did not end where its length said")
            return view[:size].toreadonly()
        if kind == b"_":  # RESP3's nil, should the server send one
            return None
        return self._error(line, "GET")

    def status(self) -> bool | Exception:
        line = self._line()
        if line[:1] == b"+":
            return True
        return self._error(line, "SET")

    def _error(self, line: bytes, command: str) -> Exception:
        if line[:1] == b"-":
            return BaseParser.parse_error(line[1:].decode("utf-8", errors="replace"))
        raise InvalidResponse(f"unexpected reply to {command}: {line[:40]!r}")

    def _line(self) -> bytes:
        start = 0
        while True:
            end = self.pending.find(_CRLF, start)
            if end >= 0:
                line = bytes(self.pending[:end])
                del self.pending[: end + 2]
                return line
            if len(self.pending) > _MAX_LINE:
                raise InvalidResponse("a reply line longer than any this tier expects")
            start = max(len(self.pending) - 1, 0)
            self.pending += self._recv(_LINE_READ)

    def _fill(self, target: memoryview, size: int, checker: ValueCheck | None) -> None:
        """Read ``target`` whole; ``checker`` is fed its first ``size`` bytes as they land."""
        have = min(len(self.pending), target.nbytes)
        target[:have] = self.pending[:have]
        del self.pending[:have]
        value = target[:size]
        while have < target.nbytes:
            if checker is not None:
                checker.fed(value, min(have, size))
            got = _io(self.sock.recv_into, target[have:])
            if not got:
                raise RedisConnectionError("Connection closed by server.")
            have += got

    def _skip(self, nbytes: int) -> None:
        """Read past ``nbytes`` of the stream without keeping them."""
        have = min(len(self.pending), nbytes)
        del self.pending[:have]
        scratch = memoryview(bytearray(min(_SKIP_PIECE, nbytes)))
        while have < nbytes:
            got = _io(self.sock.recv_into, scratch[: min(scratch.nbytes, nbytes - have)])
            if not got:
                raise RedisConnectionError("Connection closed by server.")
            have += got

    def _recv(self, nbytes: int) -> bytes:
        data = _io(self.sock.recv, nbytes)
        if not data:
            raise RedisConnectionError("Connection closed by server.")
        return data


def _int(line: bytes) -> int:
    try:
        return int(line[1:])
    except ValueError:
        raise InvalidResponse(f"bad length line {line[:40]!r}") from None
