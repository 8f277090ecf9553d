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
