"""A stopped, hung, full, evicting or read-only server: calls fail fast and typed, data stays honest."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from connector.tiers.base import ChunkCorrupt, ChunkMissing
from connector.tiers.redis_tier import RedisTier, RemoteUnavailable

from .helpers import MB, name, payload
from .servers import free_port


def _calls(tier: RedisTier) -> dict[str, Callable[[], object]]:
    """Every operation, each expected to raise RemoteUnavailable or return it per item."""

    def per_item(results: list) -> None:
        assert results and all(isinstance(r, RemoteUnavailable) for r in results), results
        raise results[0]

    return {
        "put": lambda: tier.put(name(9), payload(MB)),
        "get": lambda: tier.get(name(1)),
        "delete": lambda: tier.delete(name(1)),
        "exists_many": lambda: tier.exists_many([name(i) for i in range(32)]),
        "put_many": lambda: per_item(tier.put_many([(name(i), payload(1000)) for i in range(4)])),
        "get_many": lambda: per_item(tier.get_many([name(i) for i in range(8)])),
        "ping": tier.ping,
        "clear": tier.clear,
    }


def _fails_fast(call: Callable[[], object], kinds: set[str], bound_s: float) -> RemoteUnavailable:
    """``call`` raises RemoteUnavailable of one of ``kinds`` within ``bound_s`` (``call_bound_s``)."""
    start = time.monotonic()
    with pytest.raises(RemoteUnavailable) as info:
        call()
    elapsed = time.monotonic() - start
    assert elapsed < bound_s, f"took {elapsed:.2f}s (bound {bound_s:.2f}s)"
    assert info.value.kind in kinds, info.value
    return info.value


def test_stopped_server_fails_every_call_fast_and_same_tier_works_after_restart(
    server_factory, tier_factory, call_bound_s
):
    server = server_factory()
    tier = tier_factory(server.url, timeout_s=0.5, connect_timeout_s=0.5)
    bound_s = call_bound_s(server.url)
    tier.put(name(1), payload(1000))
    server.stop()
    for op, call in _calls(tier).items():
        error = _fails_fast(call, {"connection"}, bound_s)
        assert error.op == op or op in ("put_many", "get_many")
        assert f"127.0.0.1:{server.port}" in str(error)
    server.start()  # same port, empty (no persistence)
    with pytest.raises(ChunkMissing):
        tier.get(name(1))
    tier.put(name(1), payload(1000, 5))
    assert tier.get(name(1)) == payload(1000, 5)


def test_nothing_listening_fails_fast(tier_factory, call_bound_s, redis_server):
    bound_s = call_bound_s(redis_server.url)  # this machine's own work, against a live server
    tier = tier_factory(f"redis://127.0.0.1:{free_port()}/0")
    _fails_fast(lambda: tier.get(name(1)), {"connection"}, bound_s)
    _fails_fast(lambda: tier.exists_many([name(1)]), {"connection"}, bound_s)


def test_hung_server_fails_calls_within_the_timeout_then_recovers(server_factory, tier_factory, call_bound_s):
    server = server_factory()
    tier = tier_factory(server.url, timeout_s=0.5, connect_timeout_s=0.5)
    bound_s = call_bound_s(server.url)
    tier.put(name(1), payload(MB))  # a pooled connection exists: the hang is met mid-call
    server.pause()
    try:
        calls = _calls(tier)
        for op in ("get", "put", "exists_many", "get_many", "ping"):
            _fails_fast(calls[op], {"timeout"}, bound_s)
    finally:
        server.resume()
    assert tier.get(name(1)) == payload(MB)


def test_evicting_server_turns_old_chunks_into_misses_never_corruption(server_factory, tier_factory):
    server = server_factory("--maxmemory", "24mb", "--maxmemory-policy", "allkeys-lru")
    tier = tier_factory(server.url)
    names = [name(i) for i in range(48)]
    for i, n in enumerate(names):
        tier.put(n, payload(MB, i))
    present = tier.exists_many(names)
    assert present.count(False) >= 16, present
    assert present[-1] and not all(present[:8])  # the oldest went first
    with pytest.raises(ChunkMissing):
        tier.get(names[present.index(False)])
    assert tier.get(names[-1]) == payload(MB, 47)
    # Reading ~24 MB back fills the server's output buffers, which makes it evict more while
    # it answers: each chunk must then be whole or missing, never anything else.
    got = tier.get_many(names)
    for i, (n, item) in enumerate(zip(names, got, strict=True)):
        if isinstance(item, memoryview):
            assert present[i] and item == payload(MB, i), n
        else:
            assert isinstance(item, ChunkMissing), (n, item)


def test_full_server_without_eviction_refuses_puts_as_oom(server_factory, tier_factory):
    server = server_factory("--maxmemory", "8mb", "--maxmemory-policy", "noeviction")
    tier = tier_factory(server.url)
    stored: list[int] = []
    with pytest.raises(RemoteUnavailable) as info:
        for i in range(32):
            tier.put(name(i), payload(MB, i))
            stored.append(i)
    assert info.value.kind == "oom" and info.value.op == "put", info.value
    results = tier.put_many([(name(100 + i), payload(MB)) for i in range(3)])
    assert all(isinstance(r, RemoteUnavailable) and r.kind == "oom" for r in results)
    assert stored and tier.get(name(stored[0])) == payload(MB, stored[0])  # reads still served
    tier.clear()  # UNLINK is allowed when full, and frees the room
    tier.put(name(0), payload(MB))


def test_read_only_replica_refuses_puts_as_readonly(server_factory, tier_factory):
    primary = server_factory("--repl-diskless-sync-delay", "0")
    replica = server_factory("--replicaof", "127.0.0.1", str(primary.port))
    writer = tier_factory(primary.url, key_prefix="ro")
    writer.put(name(1), payload(1000))
    tier = tier_factory(replica.url, key_prefix="ro")
    with pytest.raises(RemoteUnavailable) as info:
        tier.put(name(2), payload(1000))
    assert info.value.kind == "readonly"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # replication is asynchronous
        try:
            assert tier.get(name(1)) == payload(1000)
            break
        except (ChunkMissing, RemoteUnavailable):
            time.sleep(0.05)
    else:
        pytest.fail("replica never served the chunk")


def test_failures_never_pass_for_data_errors(server_factory, tier_factory):
    server = server_factory()
    tier = tier_factory(server.url)
    server.stop()
    (item,) = tier.get_many([name(1)])
    assert isinstance(item, RemoteUnavailable) and not isinstance(item, (ChunkMissing, ChunkCorrupt))
