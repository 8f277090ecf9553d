"""Tensor parallelism (TP=2, one core per rank): each rank stores and loads its own share, the
workers' reports merge into one per request (tokens counted once), per-rank gauges are summed,
and a load that fails on one rank only is recomputed and healed."""

import re

import pytest

from ..telemetry.serve import free_port
from . import workloads as w
from .conftest import disk_kv, lmcache_tokens, outputs, run_engine

pytestmark = pytest.mark.integration

TP = {"tensor_parallel_size": 2}
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
# float32 tiny model, one rank's share: one 256-token chunk is 512 KiB; two chunks fit the CPU tier.
CPU_GB = 2 * 512 * 1024 / 1024**3


@pytest.fixture(scope="module")
def tp_baseline(tiny_model, tmp_path_factory):
    spec = {"model": tiny_model, "kv": None, "engine": TP, "rounds": [{"prompts": [w.A]}]}
    return outputs(run_engine(spec, tmp_path_factory.mktemp("tp-base"), env=ENV)["rounds"][0])


@pytest.fixture(scope="module")
def tp_run(tiny_model, tmp_path_factory):
    disk = str(tmp_path_factory.mktemp("kv-tp"))
    kv = disk_kv(disk, local_cpu=True, max_local_cpu_size=CPU_GB)
    rounds = [
        {"prompts": [w.A]},  # chunks 0-1 in both tiers; the tail block on disk only
        {"prompts": [w.A]},
        # Rank 1's copy of the tail block (the smallest file) turns corrupt; rank 0's is fine.
        {"prompts": [w.A], "damage": {"dir": disk, "corrupt": 1, "rank": 1, "smallest": True}},
        {"prompts": [w.A]},
    ]
    spec = {"model": tiny_model, "kv": kv, "engine": TP, "rounds": rounds}
    return run_engine(
        spec, tmp_path_factory.mktemp("tp"), env={**ENV, "KVLENS_METRICS_PORT": str(free_port())}
    )


def test_outputs_equal_vllm_with_the_same_parallel_layout(tp_run, tp_baseline):
    for rnd in tp_run["rounds"]:
        assert outputs(rnd) == tp_baseline


def test_the_merged_report_counts_each_token_once(tp_run):
    hit = tp_run["rounds"][1][0]["kv_transfer_params"]["kvlens"]
    assert hit["loaded_tokens"] == {"cpu": 512, "disk": 128}
    assert hit["failed_blocks"] == 0


def test_a_load_failing_on_one_rank_is_recomputed_and_healed(tp_run):
    by_round = tp_run["state"]["failed_blocks_by_round"]
    assert by_round[2] and by_round[3] == []
    failed = tp_run["rounds"][2][0]["kv_transfer_params"]["kvlens"]
    assert failed["failed_blocks"] >= 1 and failed["recomputed_tokens"] == 128
    assert lmcache_tokens(tp_run["rounds"][3]) == [640]  # the recompute stored it again


def _gauge(text: str, name: str, tier: str) -> float:
    m = re.search(rf'^{name}\{{[^}}]*tier="{tier}"[^}}]*\}} (\S+)$', text, re.M)
    assert m, name
    return float(m.group(1))


def test_per_rank_gauges_are_summed_over_ranks(tp_run):
    text = tp_run["state"]["metrics"]
    index = _gauge(text, "vllm:kvlens_tier_used_bytes", "cpu")  # one rank's share
    assert index > 0
    assert _gauge(text, "vllm:kvlens_tier_stored_bytes", "cpu") == 2 * index


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    from ..redis.servers import REDIS_SERVER, RedisServer

    if not REDIS_SERVER:
        pytest.skip("redis-server not installed (bash scripts/setup.sh)")
    server = RedisServer(tmp_path_factory.mktemp("tp-redis"))
    try:
        yield server.start().url
    finally:
        server.kill()


@pytest.fixture(scope="module")
def tp_fault_run(tiny_model, tmp_path_factory, redis_url):
    """Disk and Redis tiers, vLLM's default failure policy (``fail``). Round 3 loads the two
    shared chunks from disk in the step; rank 1's copy of one of them is damaged, rank 0's is
    sound, and the same step computes and stores the chunks after them."""
    disk = str(tmp_path_factory.mktemp("kv-tp-fault"))
    kv = disk_kv(disk, remote_url=redis_url)
    kv["lmcache.extra_config"] = {"remote_key_prefix": "tp", "remote_lookup_timeout_ms": 1000}
    rounds = [
        {"prompts": [w.SHARED]},  # chunks 0 and 1, on both ranks, on disk and in Redis
        {"prompts": [w.A]},  # loads them (the disk's speed is measured), stores A's tail
        {
            "prompts": [w.B_LONGER],
            "damage": {"dir": disk, "corrupt": 1, "rank": 1, "largest": True},  # a whole chunk
        },
        {"prompts": [[1, 2, 3]], "sleep_s": 1.0},  # one more step: every report has arrived
    ]
    spec = {"model": tiny_model, "kv": kv, "engine": TP, "rounds": rounds, "policy": "fail"}
    return run_engine(spec, tmp_path_factory.mktemp("tp-fault"), env=ENV)


def _redis_ranks(url: str, prefix: str) -> dict[str, set[str]]:
    import redis

    client = redis.Redis.from_url(url)
    ranks: dict[str, set[str]] = {}
    for key in client.scan_iter(match=f"{prefix}:*"):
        name = key.decode().split(":", 1)[1]
        m = re.fullmatch(r"([0-9a-f]{32})\.r(\d+)", name)
        if m:
            ranks.setdefault(m.group(1), set()).add(m.group(2))
    return ranks


def test_a_store_over_a_load_failing_on_one_rank_is_written_by_no_rank(tp_fault_run, redis_url):
    """Rank 0 computed B's later chunks over rank 1's failed load: their KV is wrong on every
    rank, so no rank writes them, in any tier: Redis, whose copies KVLens never deletes for a
    dependency, holds no half of them (a half becomes loadable across the fleet once another
    engine writes the other rank's half)."""
    assert tp_fault_run["state"]["failed_blocks_by_round"][2], "rank 1's load failed"
    ranks = _redis_ranks(redis_url, "tp")
    assert len(ranks) >= 3  # rounds 1 and 2 stored chunks 0, 1 and A's tail on both ranks
    halves = {digest: r for digest, r in ranks.items() if r != {"0", "1"}}
    assert halves == {}, f"chunks stored by one rank only: {halves}"
