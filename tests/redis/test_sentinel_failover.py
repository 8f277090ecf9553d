"""Redis Sentinel losing its master: bounded failures, then the same tier writes and reads on the
promoted replica (found through the sentinels), and what was replicated before is still there."""

from __future__ import annotations

import time

from connector.tiers.base import ChunkMissing
from connector.tiers.redis_tier import RemoteUnavailable

from .helpers import name, payload

KB = 1024


def test_killed_master_fails_over_and_the_same_tier_serves_again(
    private_sentinels, tier_factory, call_bound_s
):
    tier = tier_factory(private_sentinels.url, timeout_s=0.5, connect_timeout_s=0.5)
    bound_s = call_bound_s(private_sentinels.url)
    names = [name(i) for i in range(16)]
    assert tier.put_many([(n, payload(32 * KB, i)) for i, n in enumerate(names)]) == [None] * 16
    old = private_sentinels.current_master()
    replica = next(s for s in private_sentinels.servers if s is not old)
    private_sentinels.wait_replicated()
    old.kill()

    fresh = [name(1000 + i) for i in range(8)]
    failures = 0
    deadline = time.monotonic() + 30
    while True:
        start = time.monotonic()
        results = tier.put_many([(n, payload(8 * KB, 7)) for n in fresh])
        assert time.monotonic() - start < bound_s  # a dead master costs one bounded call, no hang
        if all(r is None for r in results):
            break
        assert all(isinstance(r, RemoteUnavailable) for r in results if r is not None), results
        failures += 1
        assert time.monotonic() < deadline, f"no failover: {results[0]}"
        time.sleep(0.2)

    assert failures > 0  # the kill was seen, then the tier found the new master by itself
    assert private_sentinels.master_port() == replica.port
    with replica.client() as direct:  # the writes went to the promoted replica
        assert direct.exists(*(tier.key(n) for n in fresh)) == len(fresh)
    assert tier.exists_many(fresh) == [True] * 8
    for i, got in enumerate(tier.get_many(names)):
        assert not isinstance(got, ChunkMissing | RemoteUnavailable), (i, got)
        assert got == payload(32 * KB, i)  # replicated before the kill
    tier.clear()
    assert tier.exists_many(names + fresh) == [False] * 24


def test_ping_alone_sees_the_failover(private_sentinels, tier_factory, call_bound_s):
    """A tier marked skipped only pings until it answers: the ping must follow the sentinels to the
    new master, or a failed-over master keeps the remote tier skipped forever."""
    tier = tier_factory(private_sentinels.url, timeout_s=0.5, connect_timeout_s=0.5)
    bound_s = call_bound_s(private_sentinels.url)
    assert tier.put_many([(name(1), payload(KB, 1))]) == [None]
    tier.ping()
    old = private_sentinels.current_master()
    private_sentinels.wait_replicated()
    old.kill()
    deadline = time.monotonic() + 30
    failed = False
    while True:
        start = time.monotonic()
        try:
            tier.ping()
            break
        except RemoteUnavailable:
            failed = True
            assert time.monotonic() - start < bound_s
            assert time.monotonic() < deadline, "the ping never reached the promoted replica"
            time.sleep(0.2)
    assert failed
    assert private_sentinels.master_port() != old.port
    assert tier.get(name(1)) == payload(KB, 1)
