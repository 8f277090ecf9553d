"""A Redis Cluster losing or hanging a master: bounded failures, then service again, never corruption."""

from __future__ import annotations

import time

import pytest

from connector.tiers.base import ChunkMissing
from connector.tiers.redis_tier import RemoteUnavailable

from .helpers import name, payload

KB = 1024


def test_killed_master_fails_over_and_the_same_tier_serves_again(private_cluster, tier_factory, call_bound_s):
    tier = tier_factory(private_cluster.url, timeout_s=0.5, connect_timeout_s=0.5)
    bound_s = call_bound_s(private_cluster.url)
    names = [name(i) for i in range(48)]
    assert tier.put_many([(n, payload(32 * KB, i)) for i, n in enumerate(names)]) == [None] * 48
    private_cluster.wait_replicated()
    victim = private_cluster.master_of(tier.key(names[0]))
    victim.kill()

    fresh = [name(1000 + i) for i in range(24)]
    deadline = time.monotonic() + 30
    while True:
        start = time.monotonic()
        results = tier.put_many([(n, payload(8 * KB, 7)) for n in fresh])
        assert time.monotonic() - start < bound_s
        if all(r is None for r in results):
            break
        assert all(isinstance(r, RemoteUnavailable) for r in results if r is not None), results
        assert time.monotonic() < deadline, f"no failover: {results[0]}"
        time.sleep(0.2)

    assert tier.exists_many(fresh) == [True] * 24
    for i, (n, got) in enumerate(zip(names, tier.get_many(names), strict=True)):
        assert isinstance(got, (memoryview, ChunkMissing)), (n, got)
        if isinstance(got, memoryview):
            assert got == payload(32 * KB, i), n
    assert tier.get(names[0]) == payload(
        32 * KB, 0
    )  # replicated before the kill: the promoted replica has it
    tier.clear()
    assert tier.exists_many(names + fresh) == [False] * 72


def test_ping_alone_sees_the_failover(private_cluster, tier_factory, call_bound_s):
    """A tier marked skipped only pings until it works again: the ping must re-read the slot map,
    or a killed master keeps the probe (and the tier) failing forever."""
    tier = tier_factory(private_cluster.url, timeout_s=0.5, connect_timeout_s=0.5)
    bound_s = call_bound_s(private_cluster.url)
    assert tier.put_many([(name(1), payload(KB, 1))]) == [None]
    tier.ping()
    private_cluster.wait_replicated()
    private_cluster.live()[0].kill()
    deadline = time.monotonic() + 30
    while True:
        start = time.monotonic()
        try:
            tier.ping()
            break
        except RemoteUnavailable:
            assert time.monotonic() - start < bound_s
            assert time.monotonic() < deadline, "ping never recovered after the failover"
            time.sleep(0.2)
    # A live node answers a ping before the replica is promoted; writes to the killed master's
    # slots wait for the promotion (on a busy machine it came after the ping: ClusterDownError).
    private_cluster.wait_ok(timeout_s=30)
    assert tier.put_many([(name(2), payload(KB, 2))]) == [None]


def test_hung_master_costs_one_timeout_per_call_not_one_per_chunk(
    private_cluster, tier_factory, call_bound_s
):
    tier = tier_factory(private_cluster.url, timeout_s=0.5, connect_timeout_s=0.5)
    bound_s = call_bound_s(private_cluster.url)
    names = [name(i) for i in range(96)]
    assert tier.put_many([(n, payload(4 * KB, i)) for i, n in enumerate(names)]) == [None] * 96
    hung = private_cluster.master_of(tier.key(names[0]))
    hung.pause()
    try:
        start = time.monotonic()
        got = tier.get_many(names)
        assert time.monotonic() - start < bound_s
        failed = [isinstance(g, RemoteUnavailable) for g in got]
        assert failed[0] and 10 < sum(failed) < 96  # only the hung master's share
        for i, g in enumerate(got):
            assert failed[i] or g == payload(4 * KB, i)
        start = time.monotonic()
        with pytest.raises(RemoteUnavailable) as info:
            tier.exists_many(names)
        assert time.monotonic() - start < bound_s and info.value.kind == "timeout"
    finally:
        hung.resume()
    # The paused master may have been failed over meanwhile; either way the tier comes back.
    private_cluster.wait_ok(timeout_s=30)
    deadline = time.monotonic() + 15
    while not all(isinstance(g, memoryview) for g in tier.get_many(names[:8])):
        assert time.monotonic() < deadline, "tier did not recover after the master resumed"
        time.sleep(0.2)
