"""The remote tier against a real redis-server (over TCP and a Unix socket), a real 3-master
Redis Cluster, and a master found through real Redis Sentinels."""

from __future__ import annotations

import threading
import time
import tracemalloc

import pytest
import redis

from connector.tiers import redis_tier
from connector.tiers.base import ChunkCorrupt, ChunkMissing, Tier
from connector.tiers.redis_tier import RemoteUnavailable

from .helpers import MB, name, payload


@pytest.fixture(params=["single", "cluster", "unix", "sentinel"])
def url(request: pytest.FixtureRequest) -> str:
    if request.param == "single":
        return request.getfixturevalue("redis_server").url
    if request.param == "unix":
        return request.getfixturevalue("redis_unix_server").unix_url
    if request.param == "sentinel":
        return request.getfixturevalue("redis_sentinels").url
    return request.getfixturevalue("redis_cluster").url


@pytest.fixture
def raw(url: str, request: pytest.FixtureRequest) -> redis.Redis | redis.RedisCluster:
    """A plain redis-py client on the same server or cluster, to look behind the tier."""
    if url.startswith("redis-cluster"):
        host, port = url.split("://")[1].split(",")[0].split(":")
        client: redis.Redis | redis.RedisCluster = redis.RedisCluster(host=host, port=int(port))
    elif url.startswith("unix"):
        client = request.getfixturevalue("redis_unix_server").client()
    elif url.startswith("redis-sentinel"):
        client = request.getfixturevalue("redis_sentinels").current_master().client()
    else:
        client = request.getfixturevalue("redis_server").client()
    yield client
    client.close()


def test_multi_megabyte_payload_round_trips_exactly(url, tier_factory):
    tier = tier_factory(url)
    assert isinstance(tier, Tier) and tier.name == "remote"
    data = payload(6 * MB)
    written = tier.put(name(1), data)
    assert written > data.nbytes  # the record's header comes on top
    got = tier.get(name(1))
    assert got.nbytes == data.nbytes and got == data


def test_one_key_per_chunk_holding_one_codec_record(url, tier_factory, raw):
    tier = tier_factory(url, key_prefix="onekey")
    data = payload(4096)
    tier.put(name(2), data)
    value = raw.get(f"onekey:{name(2)}")
    assert value.startswith(b"KVLENS1\n") and value.endswith(bytes(data))
    assert len(value) == tier.put(name(2), data)


def test_missing_name_is_chunk_missing(url, tier_factory):
    with pytest.raises(ChunkMissing):
        tier_factory(url).get(name(3))


def test_exists_many_on_present_and_absent_names(url, tier_factory):
    tier = tier_factory(url)
    names = [name(i) for i in range(40)]
    for n in names[::3]:
        tier.put(n, payload(256))
    assert tier.exists_many(names) == [i % 3 == 0 for i in range(40)]
    assert tier.exists_many([]) == []


def _count_sends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts connections taken from any pool: one per round trip of a batch (a redis-py
    pipeline, or the GETs and SETs ``redis_wire`` writes to a connection's socket itself)."""
    sends = [0]
    original = redis.connection.ConnectionPool.get_connection

    def counting(self, *args, **kwargs):
        sends[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(redis.connection.ConnectionPool, "get_connection", counting)
    return sends


@pytest.mark.parametrize("count", [16, 128])
def test_exists_many_is_one_round_trip_per_node_and_moves_no_values(
    url, tier_factory, raw, monkeypatch, count
):
    tier = tier_factory(url)
    names = [name(i) for i in range(count)]
    tier.put_many([(n, payload(64 * 1024)) for n in names[::2]])
    tier.ping()  # connections are open: only the lookup's own writes are counted below
    nodes = 3 if url.startswith("redis-cluster") else 1
    before = _commandstats(raw)
    sends = _count_sends(monkeypatch)
    assert tier.exists_many(names) == [i % 2 == 0 for i in range(count)]
    assert sends[0] == nodes
    after = _commandstats(raw)
    assert after.get("exists", 0) - before.get("exists", 0) == count
    assert after.get("get", 0) == before.get("get", 0)


def _commandstats(raw: redis.Redis | redis.RedisCluster) -> dict[str, int]:
    """Calls per command, summed over masters."""
    if isinstance(raw, redis.RedisCluster):
        stats = raw.info("commandstats", target_nodes=redis.RedisCluster.PRIMARIES)
        per_node = stats.values() if all(isinstance(v, dict) for v in stats.values()) else [stats]
    else:
        per_node = [raw.info("commandstats")]
    totals: dict[str, int] = {}
    for node in per_node:
        for key, value in node.items():
            if key.startswith("cmdstat_"):
                totals[key[8:]] = totals.get(key[8:], 0) + int(value["calls"])
    return totals


def test_batches_spread_over_every_master(redis_cluster, tier_factory, monkeypatch):
    tier = tier_factory(redis_cluster.url)
    names = [name(i) for i in range(64)]
    tier.ping()
    sends = _count_sends(monkeypatch)
    assert tier.put_many([(n, payload(1024, i)) for i, n in enumerate(names)]) == [None] * 64
    assert sends[0] == 3
    got = tier.get_many(names)
    assert sends[0] == 6
    assert got == [payload(1024, i) for i in range(64)]


def test_put_many_and_get_many_per_item_results(url, tier_factory):
    tier = tier_factory(url)
    items = [(name(i), payload(100_000 + i, i)) for i in range(12)]
    assert tier.put_many(items) == [None] * 12
    asked = [name(0), name(99), name(5), name(11)]
    got = tier.get_many(asked)
    assert got[0] == items[0][1] and got[2] == items[5][1] and got[3] == items[11][1]
    assert isinstance(got[1], ChunkMissing)
    assert tier.get_many([]) == [] and tier.put_many([]) == []


def test_get_many_reports_a_corrupt_item_without_failing_the_others(url, tier_factory, raw):
    tier = tier_factory(url, key_prefix="mixed")
    tier.put_many([(name(0), payload(5000)), (name(1), payload(5000))])
    raw.setrange(f"mixed:{name(1)}", 200, b"\x00\xff\x00")
    good, bad, missing = tier.get_many([name(0), name(1), name(2)])
    assert isinstance(good, memoryview) and good.nbytes == 5000
    assert isinstance(bad, ChunkCorrupt) and isinstance(missing, ChunkMissing)


def test_delete_forgets_and_tolerates_missing(url, tier_factory):
    tier = tier_factory(url)
    tier.put(name(1), payload(1000))
    tier.delete(name(1))
    tier.delete(name(1))
    with pytest.raises(ChunkMissing):
        tier.get(name(1))


def test_clear_removes_only_its_own_prefix(url, tier_factory, raw):
    mine = tier_factory(url, key_prefix="clearme")
    near = tier_factory(url, key_prefix="clearme-not")
    for i in range(30):
        mine.put(name(i), payload(512))
    near.put(name(0), payload(512))
    raw.set("clearme", b"a bare key with the prefix as its whole name")
    raw.set("unrelated:key", b"x")
    mine.clear()
    assert mine.exists_many([name(i) for i in range(30)]) == [False] * 30
    assert near.exists_many([name(0)]) == [True]
    assert raw.get("clearme") and raw.get("unrelated:key") == b"x"
    mine.clear()  # clearing an empty prefix is fine


def test_two_prefixes_never_see_each_other(url, tier_factory):
    a = tier_factory(url, key_prefix="tenant-a")
    b = tier_factory(url, key_prefix="tenant-b")
    a.put(name(7), payload(1000, 1))
    assert b.exists_many([name(7)]) == [False]
    with pytest.raises(ChunkMissing):
        b.get(name(7))
    b.put(name(7), payload(1000, 2))
    assert a.get(name(7)) == payload(1000, 1) and b.get(name(7)) == payload(1000, 2)


def test_ttl_is_set_and_honoured(url, tier_factory, raw):
    tier = tier_factory(url, key_prefix="ttl", ttl_s=1)
    forever = tier_factory(url, key_prefix="nottl")
    tier.put(name(1), payload(1000))
    tier.put_many([(name(2), payload(1000))])
    forever.put(name(1), payload(1000))
    assert 0 < raw.pttl(f"ttl:{name(1)}") <= 1000 and 0 < raw.pttl(f"ttl:{name(2)}") <= 1000
    assert raw.ttl(f"nottl:{name(1)}") == -1
    time.sleep(1.2)
    with pytest.raises(ChunkMissing):
        tier.get(name(1))
    assert tier.exists_many([name(1), name(2)]) == [False, False]
    assert forever.exists_many([name(1)]) == [True]


def test_writer_thread_and_reader_share_one_tier(url, tier_factory):
    tier = tier_factory(url)
    names = [name(i) for i in range(16)]
    data = {n: payload(256 * 1024, i) for i, n in enumerate(names)}
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer() -> None:
        try:
            while not stop.is_set():
                for n in names:
                    tier.put(n, data[n])
                tier.put_many([(n, data[n]) for n in names[:4]])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        deadline = time.monotonic() + 1.0
        reads = 0
        while time.monotonic() < deadline:
            for n, got in zip(names, tier.get_many(names), strict=True):
                if isinstance(got, ChunkMissing):
                    continue
                assert isinstance(got, memoryview), got
                assert got == data[n]
                reads += 1
            tier.exists_many(names)
    finally:
        stop.set()
        thread.join()
    assert not errors and reads > 0


def test_constructor_refuses_prefixes_that_could_overlap_and_bad_ttls(redis_server):
    from connector.tiers.remote_url import parse_remote_url

    url = parse_remote_url(redis_server.url, environ={})
    for prefix in ["", "a:b", "a*", "a b", "x?"]:
        with pytest.raises(ValueError, match="key_prefix"):
            redis_tier.RedisTier(url, "l", key_prefix=prefix)
    for ttl in [0, -1, 1.5, True]:
        with pytest.raises(ValueError, match="ttl_s"):
            redis_tier.RedisTier(url, "l", ttl_s=ttl)


def test_ping_measures_a_round_trip(url, tier_factory):
    assert 0 < tier_factory(url).ping() < 1.0


def test_failure_is_remote_unavailable_an_oserror():
    assert issubclass(RemoteUnavailable, OSError)


def test_put_sends_the_payload_without_copying_it(redis_server, tier_factory):
    tier = tier_factory(redis_server.url)
    data = payload(8 * MB)
    tier.put(name(1), data)  # connections and buffers exist before measuring
    tracemalloc.start()
    try:
        tier.put(name(1), data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < data.nbytes / 16  # the record's header and the command's frame, not the payload
