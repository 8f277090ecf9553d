"""Remote tier: chunks in Redis, Valkey or a Redis Cluster, one self-checking record per key.

Each value is exactly one codec record written by one ``SET``, so a reader sees a whole record
or none; eviction or an expired TTL on the server is a plain miss. Batches go out as one
pipeline per server (per master in a cluster): a lookup of many chunks costs one round trip
per node, never one per chunk. Sockets carry timeouts and redis-py's own retries are off, so a
stopped, hung or unreachable server fails a call in about ``timeout_s``; every such failure is
one exception type, ``RemoteUnavailable``, whose message names the operation and the redacted
URL, so callers can count failures and mark the tier unhealthy.

Cluster batches are routed here rather than through redis-py's cluster pipeline, which re-sends
each command of a node that timed out one at a time (a hung master would cost one timeout per
chunk). After a topology error (a refused connection, ``MOVED``) the slot map is refreshed and
the affected commands are sent once more; nothing else is retried.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Sequence
from typing import Any

from redis import Redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    AskError,
    AuthenticationError,
    BusyLoadingError,
    ClusterDownError,
    MovedError,
    NoPermissionError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from . import codec
from .base import ChunkCorrupt, ChunkMissing
from .remote_url import RemoteURL

try:  # redis-py >= 5.1
    from redis.exceptions import OutOfMemoryError
except ImportError:  # pragma: no cover - older redis-py reports OOM as a plain ResponseError
    OutOfMemoryError = ResponseError  # type: ignore[misc,assignment]

_PREFIX = re.compile(r"^[A-Za-z0-9_.\-]+$")
_SCAN_COUNT = 1000
_DETAIL_CHARS = 300
_STALE_REFRESH_S = 1.0  # at most one slot-map refresh a second after timeouts


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
        if url.tls:
            options.update(ssl=True, ssl_ca_certs=url.ssl_ca_certs, ssl_cert_reqs=url.ssl_cert_reqs)
        self._nodes: _Single | _Cluster = _Cluster(url, options) if url.cluster else _Single(url, options)

    def __repr__(self) -> str:
        return f"RedisTier({self._where}, key_prefix={self.key_prefix!r})"

    def key(self, name: str) -> str:
        return f"{self.key_prefix}:{name}"

    # --- Tier protocol ---------------------------------------------------------------------------

    def put(self, name: str, payload: memoryview, namespace: str = "") -> int:
        """Store ``payload`` under ``name``; returns the bytes of the record written."""
        record = self._record(name, payload, namespace)
        (reply,) = self._run("put", [self._set(name, record)])
        _raise_if_error(self._stored(reply, "put"))
        return record.nbytes

    def get(self, name: str) -> memoryview:
        """The payload as a read-only view over the bytes redis-py returned (no further copy)."""
        (reply,) = self._run("get", [("GET", self.key(name))])
        return _raise_if_error(self._loaded(name, reply, "get"))

    def delete(self, name: str) -> None:
        (reply,) = self._run("delete", [("UNLINK", self.key(name))])
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

        Each item's record (one copy of its payload) is held until the batch is sent.
        ``namespaces``: per item, as in ``put`` (none given: "").
        """
        spaces = namespaces or [""] * len(items)
        commands = [
            self._set(name, self._record(name, payload, ns))
            for (name, payload), ns in zip(items, spaces, strict=True)
        ]
        return [self._stored(reply, "put_many") for reply in self._run("put_many", commands)]

    def get_many(self, names: Sequence[str]) -> list[memoryview | Exception]:
        """Per name: the payload, or ChunkMissing / ChunkCorrupt / RemoteUnavailable."""
        replies = self._run("get_many", [("GET", self.key(n)) for n in names])
        return [self._loaded(name, reply, "get_many") for name, reply in zip(names, replies, strict=True)]

    def exists_many(self, names: Sequence[str]) -> list[bool]:
        """Which names are stored, in one round trip per node; raises RemoteUnavailable."""
        replies = self._run("exists_many", [("EXISTS", self.key(n)) for n in names])
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

    def close(self) -> None:
        """Close pooled connections; a later call opens new ones."""
        self._nodes.close()

    # --- for tools over this prefix (connector/store_records.py) ---------------------------------

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
        return [self._done(reply, op) for reply in self._run(op, list(commands))]

    # --- internals -------------------------------------------------------------------------------

    def _record(self, name: str, payload: memoryview, namespace: str = "") -> memoryview:
        record = bytearray(codec.encode_header(name, self.layout, payload, namespace))
        record += payload  # the one copy of the payload: a record must go out in one SET
        return memoryview(record)

    def _set(self, name: str, record: memoryview) -> tuple[Any, ...]:
        if self.ttl_s is None:
            return ("SET", self.key(name), record)
        return ("SET", self.key(name), record, "EX", self.ttl_s)

    def _run(self, op: str, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Replies in command order; a failed command's slot holds its exception.

        Commands that a fresh slot map may fix (cluster only) are sent once more after a refresh.
        """
        replies: list[Any] = [None] * len(commands)
        pending = list(range(len(commands)))
        for attempt in (0, 1):
            try:
                groups, unroutable = self._nodes.route([commands[i][1] for i in pending])
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
                again += self._send(
                    op, client, [commands[i] for i in indices], indices, replies, attempt == 0
                )
            if not again:
                break
            self._nodes.refresh()
            pending = sorted(again)
        return replies

    def _send(
        self,
        op: str,
        client: Redis,
        commands: list[tuple[Any, ...]],
        indices: list[int],
        replies: list[Any],
        may_retry: bool,
    ) -> list[int]:
        """One pipeline to one node; fills ``replies`` and returns the indices to send again."""
        pipe = client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        try:
            results = pipe.execute(raise_on_error=False)
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
        if isinstance(reply, RemoteUnavailable):
            return reply
        if isinstance(reply, Exception):
            if failure_kind(reply) is None:  # e.g. WRONGTYPE: something else lives under our key
                return ChunkCorrupt(f"{name}: {_detail(reply, self.url.password)}")
            return self._unavailable(op, reply)
        if reply is None:
            return ChunkMissing(name)
        try:
            return codec.decode(memoryview(reply), name, self.layout)
        except ChunkCorrupt as e:
            return e

    def _unavailable(self, op: str, error: BaseException) -> RemoteUnavailable:
        if isinstance(error, RemoteUnavailable):
            return error
        kind = failure_kind(error) or "error"
        detail = _detail(error, self.url.password)
        return RemoteUnavailable(f"remote {op} on {self._where} failed ({kind}): {detail}", op=op, kind=kind)


class _Single:
    """One server: every key routes to the same pooled client."""

    def __init__(self, url: RemoteURL, options: dict[str, Any]) -> None:
        host, port = url.nodes[0]
        self._client = Redis(host=host, port=port, db=url.db, retry=_no_retry(), **options)

    def route(self, keys: list[Any]) -> tuple[list[tuple[Redis, list[int]]], dict[int, Exception]]:
        return [(self._client, list(range(len(keys))))], {}

    def masters(self) -> list[Redis]:
        return [self._client]

    def retry_after(self, error: BaseException) -> bool:
        return False  # nothing to re-route; retrying a down server only doubles the wait

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        self._client.close()


class _Cluster:
    """A Redis Cluster: keys grouped by the master owning their slot, one pipeline per master.

    redis-py's ``RedisCluster`` is used for the slot map and per-node clients only; it connects
    on first use, so a tier built while the cluster is down works once it is back.
    """

    def __init__(self, url: RemoteURL, options: dict[str, Any]) -> None:
        self._startup = [ClusterNode(host, port) for host, port in url.nodes]
        self._options = options
        self._lock = threading.Lock()
        self._client: RedisCluster | None = None
        self._stale = False  # a node timed out or the cluster was down: re-read the slot map
        self._refreshed_at = 0.0

    def _cluster(self) -> RedisCluster:
        client = self._client
        if client is None:
            with self._lock:
                if self._client is None:
                    self._client = RedisCluster(
                        startup_nodes=self._startup,
                        retry=_no_retry(),
                        require_full_coverage=False,
                        **self._options,
                    )
                client = self._client
        return client

    def route(self, keys: list[Any]) -> tuple[list[tuple[Redis, list[int]]], dict[int, Exception]]:
        cluster = self._fresh_cluster()
        groups: dict[str, tuple[Redis, list[int]]] = {}
        unroutable: dict[int, Exception] = {}
        for i, key in enumerate(keys):
            try:
                node = cluster.get_node_from_key(key)
            except RedisClusterException as e:  # slot not covered (its master is down)
                unroutable[i] = e
                continue
            group = groups.get(node.name)
            if group is None:
                group = groups[node.name] = (cluster.get_redis_connection(node), [])
            group[1].append(i)
        return list(groups.values()), unroutable

    def masters(self) -> list[Redis]:
        cluster = self._fresh_cluster()
        return [cluster.get_redis_connection(node) for node in cluster.get_primaries()]

    def retry_after(self, error: BaseException) -> bool:
        """Whether a fresh slot map may fix ``error`` now: the node is gone (refused) or the slot
        moved. A timeout or CLUSTERDOWN is not retried (that would double the wait) but makes
        the next call re-read the map, which is how a failed-over hung master is left behind."""
        if isinstance(error, (RedisTimeoutError, ClusterDownError, TryAgainError)):
            self._stale = True
            return False
        if isinstance(error, (BusyLoadingError, AuthenticationError)):
            return False
        return isinstance(error, (RedisConnectionError, MovedError))

    def refresh(self) -> None:
        self._stale = False
        self._refreshed_at = time.monotonic()
        try:
            self._cluster().nodes_manager.initialize()
        except Exception:  # noqa: BLE001 - the retried commands report the failure
            pass

    def _fresh_cluster(self) -> RedisCluster:
        if self._stale and time.monotonic() - self._refreshed_at > _STALE_REFRESH_S:
            self.refresh()
        return self._cluster()

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


def _no_retry() -> Retry:
    return Retry(NoBackoff(), 0)


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
