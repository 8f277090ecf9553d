"""Where a key of the remote tier lives: one server, a Redis Cluster, or the master Sentinel names.

Each router hands the tier (client, command indices) groups for a batch, the master clients to
PING or SCAN, says whether a call would find a connection open to every master (``warm``: the
scheduler's lookups never open one inside their budget) and whether an error means "the
topology moved, send again once", and refreshes its view when it does. redis-py's own retries
are off everywhere: a down server fails a call in about one socket timeout, and the tier counts it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from redis import Redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    ClusterDownError,
    MovedError,
    ReadOnlyError,
    RedisClusterException,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry
from redis.sentinel import Sentinel

from .remote_url import RemoteURL

_STALE_REFRESH_S = 1.0  # at most one slot-map refresh a second after timeouts


def nodes_for(url: RemoteURL, options: dict[str, Any]) -> Nodes:
    if url.cluster:
        return _Cluster(url, options)
    if url.sentinel:
        return _SentinelMaster(url, options)
    return _Single(url, options)


class _Single:
    """One server (TCP or a Unix socket): every key routes to the same pooled client."""

    def __init__(self, url: RemoteURL, options: dict[str, Any]) -> None:
        if url.socket_path is not None:
            self._client = Redis(unix_socket_path=url.socket_path, db=url.db, retry=_no_retry(), **options)
        else:
            host, port = url.nodes[0]
            self._client = Redis(host=host, port=port, db=url.db, retry=_no_retry(), **options)

    def route(self, keys: list[Any]) -> tuple[list[tuple[Redis, list[int]]], dict[int, Exception]]:
        return [(self._client, list(range(len(keys))))], {}

    def masters(self) -> list[Redis]:
        return [self._client]

    def warm(self) -> bool:
        return _pool_warm(self._client)

    def retry_after(self, error: BaseException) -> bool:
        return False  # nothing to re-route; retrying a down server only doubles the wait

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        self._client.close()


class _SentinelMaster:
    """The master that Redis Sentinel names for ``url.service_name``; reads and writes both go to
    it (a replica may lag behind what the scheduler's lookup saw). redis-py's
    ``SentinelConnectionPool`` asks the sentinels for the master whenever it opens a connection,
    so after a failover the first call fails (refused, or READONLY from the demoted master), the
    pool's connections are dropped, and the call is sent once more to the promoted replica.
    """

    def __init__(self, url: RemoteURL, options: dict[str, Any]) -> None:
        probe = {
            "socket_timeout": options["socket_connect_timeout"],
            "socket_connect_timeout": options["socket_connect_timeout"],
            "retry": _no_retry(),
        }
        self._sentinel = Sentinel(list(url.nodes), sentinel_kwargs=probe)
        assert url.service_name is not None
        self._client = self._sentinel.master_for(url.service_name, db=url.db, retry=_no_retry(), **options)

    def route(self, keys: list[Any]) -> tuple[list[tuple[Redis, list[int]]], dict[int, Exception]]:
        return [(self._client, list(range(len(keys))))], {}

    def masters(self) -> list[Redis]:
        return [self._client]

    def warm(self) -> bool:
        return _pool_warm(self._client)

    def retry_after(self, error: BaseException) -> bool:
        """A refused connection or a demoted master: the sentinels may name a new master now."""
        if isinstance(error, (RedisTimeoutError, BusyLoadingError, AuthenticationError)):
            return False
        return isinstance(error, (RedisConnectionError, ReadOnlyError))

    def refresh(self) -> None:
        self._client.connection_pool.disconnect()

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

    def warm(self) -> bool:
        """The slot map is read and current, and every master has an open connection."""
        cluster = self._client
        if cluster is None or self._stale:
            return False
        return all(_pool_warm(cluster.get_redis_connection(n)) for n in cluster.get_primaries())

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


Nodes = _Single | _Cluster | _SentinelMaster


def _pool_warm(client: Redis) -> bool:
    """Whether a call on ``client`` finds an open connection idle in its pool (opens none).

    A redis-py whose pool keeps its connections elsewhere counts as warm: calls then open
    connections where they need them, as they always did."""
    idle = getattr(client.connection_pool, "_available_connections", None)
    if idle is None:
        return True
    return any(getattr(conn, "_sock", None) is not None for conn in list(idle))


def _no_retry() -> Retry:
    return Retry(NoBackoff(), 0)
