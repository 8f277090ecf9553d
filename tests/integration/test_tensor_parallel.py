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
    from ..redis.servers import running_redis_url

    with running_redis_url(tmp_path_factory.mktemp("tp-redis")) as url:
        yield url


@pytest.fixture(scope="module")
def tp_fault_run(tiny_model, tmp_path_factory, redis_url):
    """Disk and Redis tiers, vLLM's default failure policy (``fail``). Round 2 loads the two
    shared chunks from disk in the step; rank 1's copy of one of them is damaged, rank 0's is
    sound, and the same step computes and stores the chunks after them. Loads run in the step
    as with LMCache's default (``enable_async_loading: false``): with KVLens's, a lone disk
    load runs in the step only when the disk measured fast, which a busy test machine does
    not promise."""
    disk = str(tmp_path_factory.mktemp("kv-tp-fault"))
    kv = disk_kv(disk, remote_url=redis_url, enable_async_loading=False)
    kv["lmcache.extra_config"] = {"remote_key_prefix": "tp", "remote_lookup_timeout_ms": 1000}
    rounds = [
        {"prompts": [w.SHARED]},  # chunks 0 and 1, on both ranks, on disk and in Redis
        {
            "prompts": [w.B_LONGER],
            "damage": {"dir": disk, "corrupt": 1, "rank": 1},  # one of the two, on rank 1 only
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
    assert tp_fault_run["state"]["failed_blocks_by_round"][1], "rank 1's load failed"
    ranks = _redis_ranks(redis_url, "tp")
    assert len(ranks) >= 2  # round 1 stored chunks 0 and 1 on both ranks
    halves = {digest: r for digest, r in ranks.items() if r != {"0", "1"}}
    assert halves == {}, f"chunks stored by one rank only: {halves}"


@pytest.fixture(scope="module")
def tp_abort_run(tiny_model, tmp_path_factory, redis_url):
    """Redis only (loads asynchronous), rank 1's reads slowed by its link: a request aborted
    once rank 0 has loaded its chunks while rank 1 has not started (its loads queue behind
    the slow ones), as a client that disconnects during its load is."""
    from urllib.parse import urlparse

    from ..redis.slow_proxy import SlowProxy

    proxy = SlowProxy(urlparse(redis_url).port, rank=1, delay_s=3.0)
    kv = {
        "lmcache.chunk_size": 256,
        "lmcache.local_cpu": False,
        "lmcache.remote_url": proxy.url,
        # the proxy's hop costs more than a lookup's default 50 ms on a busy machine
        "lmcache.extra_config": {"remote_key_prefix": "tp-abort", "remote_lookup_timeout_ms": 1000},
    }
    prompts = [w.A, w.B_LONGER, w.LONG[0][:800]]
    rounds = [
        {"prompts": prompts},  # stored in Redis by both ranks (writes are not slowed)
        {"prompts": prompts, "abort_once_loaded": 2, "sleep_s": 2.0},
        {"prompts": [[1, 2, 3]], "sleep_s": 1.0},  # the engine serves on
    ]
    spec = {"model": tiny_model, "kv": kv, "engine": TP, "rounds": rounds}
    try:
        yield run_engine(spec, tmp_path_factory.mktemp("tp-abort"), env=ENV)
    finally:
        proxy.close()


def test_a_client_abort_during_an_asynchronous_load_under_tp_does_not_crash_the_engine(
    tp_abort_run, tp_baseline
):
    """One rank had loaded the aborted request's chunks, the other abandoned its load before
    starting it: their outcomes still merge (the engine ran every round), and the request
    beside it is served with vLLM's own output."""
    served, _, aborted = tp_abort_run["rounds"][1]
    assert aborted is None
    assert served["token_ids"] == tp_baseline[0]
    assert tp_abort_run["rounds"][2][0]["finish_reason"] == "length"
    assert "ranks disagree" not in tp_abort_run["log"]  # every rank listed the same chunks
    assert tp_abort_run["state"]["pinned_chunks"] == 0
