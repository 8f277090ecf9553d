"""Fixtures that start real redis-server processes (and a real Redis Cluster) for the tier."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from connector.tiers.redis_tier import RedisTier
from connector.tiers.remote_url import parse_remote_url

from .servers import (
    FAILOVER_NODE_TIMEOUT_MS,
    REDIS_CLI,
    REDIS_SERVER,
    RedisClusterProcs,
    RedisSentinelGroup,
    RedisServer,
)

LAYOUT = "test-layout"

if not (REDIS_SERVER and REDIS_CLI):
    pytest.skip("redis-server / redis-cli not installed (bash scripts/setup.sh)", allow_module_level=True)

_prefixes = itertools.count()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One server shared by a module's tests; tests keep apart through their own key prefix."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        yield server.start()
    finally:
        server.kill()


@pytest.fixture(scope="module")
def redis_unix_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A server that also listens on a Unix socket (``unix_url``)."""
    server = RedisServer(tmp_path_factory.mktemp("redis-unix"), unix_socket=True)
    try:
        yield server.start()
    finally:
        server.kill()


@pytest.fixture(scope="module")
def redis_sentinels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisSentinelGroup]:
    """A master, a replica and three sentinels shared by a module's tests (none is killed)."""
    group = RedisSentinelGroup(tmp_path_factory.mktemp("sentinel"))
    try:
        yield group.start()
    finally:
        group.kill()


@pytest.fixture
def private_sentinels(tmp_path: Path) -> Iterator[RedisSentinelGroup]:
    """Sentinels of the test's own, for tests that kill the master."""
    group = RedisSentinelGroup(tmp_path / "sentinel")
    try:
        yield group.start()
    finally:
        group.kill()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcs]:
    cluster = RedisClusterProcs(tmp_path_factory.mktemp("cluster"))
    try:
        yield cluster.start()
    finally:
        cluster.kill()


@pytest.fixture
def private_cluster(tmp_path: Path) -> Iterator[RedisClusterProcs]:
    """A cluster of the test's own, for tests that kill or pause its nodes."""
    cluster = RedisClusterProcs(tmp_path / "cluster", FAILOVER_NODE_TIMEOUT_MS)
    try:
        yield cluster.start()
    finally:
        cluster.kill()


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Private servers for tests that stop, pause or fill them."""
    servers: list[RedisServer] = []

    def make(*args: str, password: str | None = None, tls: Path | None = None) -> RedisServer:
        server = RedisServer(tmp_path / f"redis{len(servers)}", *args, password=password, tls=tls)
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        server.kill()


# The socket timeouts of the tiers of tests that are not about time.
UNTIMED_S = 10.0


@pytest.fixture
def tier_factory() -> Iterator[Callable[..., RedisTier]]:
    """Tiers with a key prefix of their own, closed after the test.

    A test about timeouts passes its own (``timeout_s=0.5``, the product's default, and
    ``call_bound_s``); the others get ``UNTIMED_S``: on a slow CPU busy with two engines beside
    them a local Redis call once took longer than 0.5 s, and an eviction or a password test
    must not fail for the machine's speed."""
    tiers: list[RedisTier] = []

    def make(
        url: str, layout: str = LAYOUT, environ: dict[str, str] | None = None, **kwargs: object
    ) -> RedisTier:
        kwargs.setdefault("key_prefix", f"t{next(_prefixes)}")
        kwargs.setdefault("timeout_s", UNTIMED_S)
        kwargs.setdefault("connect_timeout_s", UNTIMED_S)
        tier = RedisTier(parse_remote_url(url, environ=environ or {}), layout, **kwargs)  # type: ignore[arg-type]
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()


# What the socket timeouts of a tier with timeout_s=0.5 and connect_timeout_s=0.5 let one failing
# call wait: about one connect plus one read timeout, twice where the call is retried once after a
# failover (a re-read slot map, another sentinel answer).
TIMEOUTS_BOUND_S = 2.0


@pytest.fixture
def call_bound_s(tier_factory) -> Callable[[str], float]:
    """``bound(url)``: the seconds one failing call of such a tier may take on this machine, its
    timeouts (``TIMEOUTS_BOUND_S``) plus ten times its own work, measured here against ``url``
    while it is healthy (a new tier connects, reads a cluster's slot map or asks the sentinels,
    and pings; the slowest of three). A slow or loaded CPU then does not pass for a hang, and a
    call that waits past its timeouts or retries without end still fails the bound."""

    def bound(url: str) -> float:
        took = []
        for _ in range(3):
            start = time.monotonic()
            tier_factory(url, timeout_s=0.5, connect_timeout_s=0.5).ping()
            took.append(time.monotonic() - start)
        return TIMEOUTS_BOUND_S + 10 * max(took)

    return bound


@pytest.fixture(scope="module")
def server_factory_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., RedisServer]]:
    """Private servers shared by one module's tests (a vllm serve lives as long)."""
    servers: list[RedisServer] = []
    root = tmp_path_factory.mktemp("redis-private")

    def make(*args: str) -> RedisServer:
        server = RedisServer(root / f"redis{len(servers)}", *args)
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        server.kill()
