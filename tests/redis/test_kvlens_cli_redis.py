"""``kvlens inspect`` and ``kvlens clear`` on a real redis-server and a real Redis Cluster: only
the prefix's keys are read or removed (SCAN + UNLINK on every master, never FLUSHDB)."""

from __future__ import annotations

import json

import redis

from connector.engine.keys import Namespace, key_fingerprint
from connector.engine.namespace_records import NamespaceRecord
from connector.ops.cli import main
from connector.tiers.store_records import RedisRecords

from .helpers import name, payload

BASE = Namespace("ckpt:abcdef0123456789|c|bfloat16|none|auto", "bfloat16", "L", 1)
SALTED = BASE.with_request(None, "tenant-secret", {})


def _fill(tier, namespace, first, n):
    tier.put_many(
        [(name(i), payload(2000, i)) for i in range(first, first + n)], [key_fingerprint(namespace)] * n
    )
    RedisRecords(tier).write_namespace(NamespaceRecord.of(namespace, 256))


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_inspect_and_clear_one_salt_namespace_under_one_prefix(redis_server, tier_factory, capsys):
    tier = tier_factory(redis_server.url, key_prefix="cli1")
    _fill(tier, BASE, 0, 5)
    _fill(tier, SALTED, 100, 3)
    raw = redis.Redis(port=redis_server.port)
    raw.set(f"cli1:{name(200)}", b"not a record")  # damaged
    raw.rpush(f"cli1:{name(201)}", b"a list")  # something else lives under a chunk's name
    raw.set("cli10:" + name(1), b"x")  # another prefix that starts alike
    raw.set("unrelated", b"y")

    report = _run(capsys, "inspect", redis_server.url, "--prefix", "cli1", "--json")
    assert report["chunks"] == 10 and report["records"] == 10 and report["damaged_records"] == 2
    by_fp = {n["fingerprint"]: n for n in report["namespaces"]}
    assert by_fp[key_fingerprint(BASE)]["chunks"] == 5 and by_fp[key_fingerprint(SALTED)]["salted"]
    assert by_fp[key_fingerprint(SALTED)]["model"] == "ckpt:abcdef0123456789"
    assert report["age_histogram"]["< 1 min"] == 8  # the damaged ones have no write time

    result = _run(capsys, "clear", redis_server.url, "--prefix", "cli1", "--salt", "tenant-secret", "--json")
    assert result["chunks"] == 3 and result["namespaces"] == [key_fingerprint(SALTED)]
    assert [tier.exists_many([name(i)])[0] for i in (0, 100)] == [True, False]
    assert raw.get("cli10:" + name(1)) == b"x" and raw.get("unrelated") == b"y"

    result = _run(capsys, "clear", redis_server.url, "--prefix", "cli1", "--all", "--json")
    assert result["chunks"] == 7 and result["namespaces"] == [key_fingerprint(BASE)]
    assert raw.keys("cli1:*") == [] and raw.get("cli10:" + name(1)) == b"x" and raw.get("unrelated") == b"y"


def test_clear_all_reaches_every_master_of_a_cluster(redis_cluster, tier_factory, capsys):
    tier = tier_factory(redis_cluster.url, key_prefix="cli2")
    other = tier_factory(redis_cluster.url, key_prefix="cli2x")
    _fill(tier, BASE, 0, 60)
    _fill(other, BASE, 0, 5)
    report = _run(capsys, "inspect", redis_cluster.url, "--prefix", "cli2", "--json")
    assert report["chunks"] == 60 and report["namespaces"][0]["chunks"] == 60
    result = _run(capsys, "clear", redis_cluster.url, "--prefix", "cli2", "--all", "--json")
    assert result["chunks"] == 60
    assert not any(tier.exists_many([name(i) for i in range(60)]))
    assert all(other.exists_many([name(i) for i in range(5)]))
