"""Remote tier: chunks in Redis, Valkey, a Redis Cluster or behind Redis Sentinel, one
self-checking record per key.

Each value is exactly one codec record written by one ``SET``, so a reader sees a whole record
or none; eviction or an expired TTL on the server is a plain miss. Batches go out as one
pipeline per server (per master in a cluster): a lookup of many chunks costs one round trip
per node, never one per chunk. Sockets carry timeouts and redis-py's own retries are off, so a
stopped, hung or unreachable server fails a call in about ``timeout_s``; every such failure is
one exception type, ``RemoteUnavailable``, whose message names the operation and the redacted
URL, so callers can count failures and mark the tier unhealthy.

What one batch sends to one node is ``redis_batches``'s: GET and SET, the commands that move
chunks, are read and written by ``redis_wire`` on redis-py's own pooled connections (values land
in reused buffers, payloads go out uncopied; loads return read-only views of those buffers).

Cluster batches are routed here rather than through redis-py's cluster pipeline, which re-sends
each command of a node that timed out one at a time (a hung master would cost one timeout per
chunk). After a topology error (a refused connection, ``MOVED``) the slot map is refreshed and
the affected commands are sent once more; nothing else is retried.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

from redis import Redis
from redis.exceptions import (
    AskError,
    AuthenticationError,
    BusyLoadingError,
    ClusterDownError,
    NoPermissionError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from . import codec
from .base import ChunkCorrupt, ChunkMissing
from .read_buffers import DEFAULT_MAX_BYTES
from .record_trust import OPEN, RecordTrust
from .redis_batches import Exchange, NodeBatches, commands, pipeline
from .redis_nodes import Nodes, nodes_for
from .remote_url import RemoteURL

try:  # redis-py >= 5.1
    from redis.exceptions import OutOfMemoryError
except ImportError:  # pragma: no cover - older redis-py reports OOM as a plain ResponseError
    OutOfMemoryError = ResponseError  # type: ignore[misc,assignment]

_PREFIX = re.compile(r"^[A-Za-z0-9_.\-]+$")
_SCAN_COUNT = 1000
_DETAIL_CHARS = 300


class RemoteUnavailable(OSError):
    """The remote store could not serve the call (down, hung, out of memory, read-only, ...).

    ``op`` is the tier operation and ``kind`` one of ``timeout``, ``connection``, ``auth``,
    ``oom``, ``readonly``, ``cluster``, ``loading``, ``error``: a closed list to count by.
    """

    def __init__(self, message: str, *, op: str = "", kind: str = "error") -> None:
        super().__init__(message)
        self.op = op
        self.kind = kind


def failure_kind(error: BaseException) -> str | None:
    """How a redis-py error counts; None for a reply about the data itself (e.g. WRONGTYPE)."""
    if isinstance(error, RedisTimeoutError):
        return "timeout"
    if isinstance(error, (AuthenticationError, NoPermissionError)):
        return "auth"
    if isinstance(error, BusyLoadingError):
        return "loading"
    if isinstance(error, RedisConnectionError):
        return "connection"
    if isinstance(error, OutOfMemoryError) or str(error).startswith("OOM"):
        return "oom"
    if isinstance(error, ReadOnlyError):
        return "readonly"
    if isinstance(error, (ClusterDownError, TryAgainError, AskError, RedisClusterException)):
        return "cluster"
    if isinstance(error, ResponseError):
        return None
    return "connection" if isinstance(error, OSError) else "error"


class RedisTier:
    """The remote tier. Thread-safe: the step thread may read while a writer thread stores."""

    name = "remote"

    def __init__(
        self,
        url: RemoteURL,
        layout: str,
        key_prefix: str = "kvlens",
        ttl_s: int | None = None,
        timeout_s: float = 0.5,
        connect_timeout_s: float = 0.5,
        max_connections: int = 32,
        read_buffer_bytes: int = DEFAULT_MAX_BYTES,
        trust: RecordTrust = OPEN,
    ) -> None:
        if not _PREFIX.match(key_prefix):
            # No ':' (one prefix must never match another's keys in clear()) and no glob characters.
            raise ValueError(f"key_prefix {key_prefix!r} must be letters, digits, '_', '.' or '-'")
        if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s <= 0):
            raise ValueError(f"ttl_s must be a positive whole number of seconds or None, not {ttl_s!r}")
        if timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError("timeout_s and connect_timeout_s must be > 0")
        self.url = url
        self.layout = layout
        self.key_prefix = key_prefix
        self.ttl_s = ttl_s
        self._where = url.redacted()
        options: dict[str, Any] = {
            "username": url.username,
            "password": url.password,
            "socket_timeout": timeout_s,
            "socket_connect_timeout": connect_timeout_s,
            "max_connections": max_connections,
            "client_name": "kvlens",
        }
        options.update(url.options)  # the URL's own redis-py options (client_name, max_connections, ...)
        if url.tls:
            options.update(ssl=True, ssl_ca_certs=url.ssl_ca_certs, ssl_cert_reqs=url.ssl_cert_reqs)
        self._nodes: Nodes = nodes_for(url, options)
        self.trust = trust  # the store key records must be tagged with, and their largest size
        self._batches = NodeBatches(layout, ttl_s, read_buffer_bytes, trust)
        self.read_buffers = self._batches.buffers  # what loads read into, reused

    def __repr__(self) -> str:
        return f"RedisTier({self._where}, key_prefix={self.key_prefix!r})"

    def key(self, name: str) -> str:
        return f"{self.key_prefix}:{name}"

    # --- Tier protocol ---------------------------------------------------------------------------

    def put(self, name: str, payload: memoryview, namespace: str = "") -> int:
        """Store ``payload`` under ``name``; returns the bytes of the record written."""
        header = codec.encode_header(name, self.layout, payload, namespace, trust=self.trust)
        keys = [self.key(name)]
        (reply,) = self._run("put", keys, self._batches.sets(keys, lambda _: header, [payload]))
        _raise_if_error(self._stored(reply, "put"))
        return len(header) + payload.nbytes

    def get(self, name: str) -> memoryview:
        """The payload as a read-only view of the buffer it was read into (no further copy)."""
        keys = [self.key(name)]
        (reply,) = self._run("get", keys, self._batches.gets([name], keys))
        return _raise_if_error(self._loaded(name, reply, "get"))

    def delete(self, name: str) -> None:
        keys = [self.key(name)]
        (reply,) = self._run("delete", keys, commands("UNLINK", keys))
        _raise_if_error(self._done(reply, "delete"))

    def clear(self) -> None:
        """Remove every key under this tier's prefix (on every master); never FLUSHDB."""
        pattern = f"{self.key_prefix}:*"
        try:
            for client in self._nodes.masters():
                batch: list[bytes] = []
                for key in client.scan_iter(match=pattern, count=_SCAN_COUNT):
                    batch.append(key)
                    if len(batch) >= _SCAN_COUNT:
                        _unlink_all(client, batch)
                        batch = []
                if batch:
                    _unlink_all(client, batch)
        except Exception as e:  # noqa: BLE001 - redis-py errors must not escape
            raise self._unavailable("clear", e) from None

    # --- batches ---------------------------------------------------------------------------------

    def put_many(
        self, items: Sequence[tuple[str, memoryview]], namespaces: Sequence[str] = ()
    ) -> list[Exception | None]:
        """Store every item in one round trip per node; per item, None or the error.

        Payloads are sent as they are (only a RESP3 connection copies each into a record first).
        ``namespaces``: per item, as in ``put`` (none given: "").
        """
        spaces = namespaces or [""] * len(items)
        if len(spaces) != len(items):
            raise ValueError(f"{len(items)} items, {len(spaces)} namespaces")
        headers: dict[int, bytes] = {}  # made as each item is sent, kept should it be sent again

        def header_of(i: int) -> bytes:
            header = headers.get(i)
            if header is None:
                name, payload = items[i]
                header = codec.encode_header(name, self.layout, payload, spaces[i], trust=self.trust)
                headers[i] = header
            return header

        keys = [self.key(name) for name, _ in items]
        replies = self._run(
            "put_many", keys, self._batches.sets(keys, header_of, [payload for _, payload in items])
        )
        return [self._stored(reply, "put_many") for reply in replies]

    def get_many(self, names: Sequence[str]) -> list[memoryview | Exception]:
        """Per name: the payload, or ChunkMissing / ChunkCorrupt / RemoteUnavailable."""
        keys = [self.key(n) for n in names]
        replies = self._run("get_many", keys, self._batches.gets(names, keys))
        return [self._loaded(name, reply, "get_many") for name, reply in zip(names, replies, strict=True)]

    def exists_many(self, names: Sequence[str]) -> list[bool]:
        """Which names are stored, in one round trip per node; raises RemoteUnavailable."""
        keys = [self.key(n) for n in names]
        replies = self._run("exists_many", keys, commands("EXISTS", keys))
        return [bool(_raise_if_error(self._done(reply, "exists_many"))) for reply in replies]

    def ping(self) -> float:
        """Seconds for a PING to the server (to every master of a cluster, one after another)."""
        start = time.perf_counter()
        for attempt in (0, 1):
            try:
                for client in self._nodes.masters():
                    client.ping()
                break
            except Exception as e:  # noqa: BLE001 - redis-py errors must not escape
                # A killed master stays in the slot map until it is re-read: a probe that never
                # re-reads it would keep a failed-over cluster skipped forever.
                if attempt == 1 or not self._nodes.retry_after(e):
                    raise self._unavailable("ping", e) from None
                self._nodes.refresh()
        return time.perf_counter() - start

    def connect(self) -> float:
        """Open (authenticate, select; discover the master or the slot map) a pooled connection to
        every master, outside any request's budget; seconds taken. Raises RemoteUnavailable."""
        return self.ping()

    def warm(self) -> bool:
        """Whether a call now finds an open connection to every master (so opens none itself)."""
        try:
            return self._nodes.warm()
        except Exception:  # noqa: BLE001 - redis-py errors must not escape
            return False

    def close(self) -> None:
        """Close pooled connections and forget the read buffers; a later call opens new ones."""
        self._nodes.close()
        self._batches.close()

    # --- for tools over this prefix (connector/tiers/store_records.py) ---------------------------------

    def node_clients(self) -> list[Redis]:
        """A client per master (the server itself when not a cluster), to SCAN this prefix's keys
        and pipeline single-key commands on them; calls raise redis-py's errors."""
        try:
            return self._nodes.masters()
        except Exception as e:  # noqa: BLE001 - redis-py errors must not escape
            raise self._unavailable("scan", e) from None

    def execute(self, op: str, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Single-key commands (the key second, under this prefix) routed as the tier's own are,
        one round trip per node; per command its reply or a RemoteUnavailable."""
        commands = list(commands)
        keys = [str(c[1]) if not isinstance(c[1], bytes) else c[1].decode() for c in commands]
        exchange: Exchange = lambda client, indices: pipeline(client, [commands[i] for i in indices])  # noqa: E731
        return [self._done(reply, op) for reply in self._run(op, keys, exchange)]

    # --- internals -------------------------------------------------------------------------------

    def _run(self, op: str, keys: list[str], exchange: Exchange) -> list[Any]:
        """Replies in key order; a failed command's slot holds its exception. ``exchange`` sends
        one node the commands of some keys (their indices) and returns their replies.

        Commands that a fresh slot map may fix (cluster only) are sent once more after a refresh.
        """
        replies: list[Any] = [None] * len(keys)
        pending = list(range(len(keys)))
        for attempt in (0, 1):
            try:
                groups, unroutable = self._nodes.route([keys[i] for i in pending])
            except Exception as e:  # noqa: BLE001 - redis-py errors must not escape
                error = self._unavailable(op, e)
                for i in pending:
                    replies[i] = error
                return replies
            for j, e in unroutable.items():
                replies[pending[j]] = self._unavailable(op, e)
            again: list[int] = []
            for client, members in groups:
                indices = [pending[j] for j in members]
                again += self._send(op, client, exchange, indices, replies, attempt == 0)
            if not again:
                break
            self._nodes.refresh()
            pending = sorted(again)
        return replies

    def _send(
        self,
        op: str,
        client: Redis,
        exchange: Exchange,
        indices: list[int],
        replies: list[Any],
        may_retry: bool,
    ) -> list[int]:
        """One batch to one node; fills ``replies`` and returns the indices to send again."""
        try:
            results = exchange(client, indices)
        except Exception as e:  # noqa: BLE001 - redis-py errors must not escape
            if self._nodes.retry_after(e) and may_retry:
                return indices
            results = [self._unavailable(op, e)] * len(indices)
        again = []
        for i, result in zip(indices, results, strict=True):
            if isinstance(result, Exception) and self._nodes.retry_after(result) and may_retry:
                again.append(i)
            else:
                replies[i] = result
        return again

    def _stored(self, reply: Any, op: str) -> Exception | None:
        error = self._done(reply, op)
        return error if isinstance(error, Exception) else None

    def _done(self, reply: Any, op: str) -> Any:
        if isinstance(reply, RemoteUnavailable):
            return reply
        if isinstance(reply, Exception):
            return self._unavailable(op, reply)
        return reply

    def _loaded(self, name: str, reply: Any, op: str) -> memoryview | Exception:
        """A ``NodeBatches.gets`` reply as the tier returns it."""
        if isinstance(reply, (RemoteUnavailable, ChunkCorrupt)):
            return reply
        if isinstance(reply, Exception):
            if failure_kind(reply) is None:  # e.g. WRONGTYPE: something else lives under our key
                return ChunkCorrupt(f"{name}: {_detail(reply, self.url.password)}")
            return self._unavailable(op, reply)
        if reply is None:
            return ChunkMissing(name)
        return reply

    def _unavailable(self, op: str, error: BaseException) -> RemoteUnavailable:
        if isinstance(error, RemoteUnavailable):
            return error
        kind = failure_kind(error) or "error"
        detail = _detail(error, self.url.password)
        return RemoteUnavailable(f"remote {op} on {self._where} failed ({kind}): {detail}", op=op, kind=kind)


def _unlink_all(client: Redis, keys: list[bytes]) -> None:
    """Single-key UNLINKs in one pipeline: keys on one cluster node may sit in different slots."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.unlink(key)
    pipe.execute()


def _raise_if_error(value: Any) -> Any:
    if isinstance(value, Exception):
        raise value
    return value


def _detail(error: BaseException, password: str | None) -> str:
    text = f"{type(error).__name__}: {error}"
    if password:
        text = text.replace(password, "***")
    return text[:_DETAIL_CHARS]
