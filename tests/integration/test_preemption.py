"""Preemption forced by a small KV cache: resumed requests reload with new blocks."""

import pytest

from . import workloads as w
from .conftest import lmcache_tokens, outputs, run_engine

pytestmark = pytest.mark.integration


ENGINE = {
    "num_gpu_blocks_override": 9,
    "max_num_seqs": 4,
    "enable_chunked_prefill": True,
    "max_num_batched_tokens": 1024,
    "max_model_len": 1024,
    # float32: a resumed request recomputes decode-time KV in a prefill; in bf16 that alone
    # can flip a later greedy token, with or without KVLens.
    "dtype": "float32",
}


@pytest.fixture(scope="module")
def preempt_baseline(tiny_model, tmp_path_factory):
    """The same engine settings without KVLens: long greedy runs depend on batch shapes."""
    rounds = [{"prompts": [p], "max_tokens": w.PREEMPT_MAX_TOKENS} for p in w.PREEMPT]
    result = run_engine(
        {"model": tiny_model, "kv": None, "engine": ENGINE, "rounds": rounds},
        tmp_path_factory.mktemp("pre-base"),
    )
    return [r[0]["token_ids"] for r in result["rounds"]]


@pytest.fixture(scope="module")
def preempt_run(tiny_model, tmp_path_factory):
    kv = {"lmcache.chunk_size": 256, "lmcache.max_local_cpu_size": 0.25}
    rounds = [
        {"prompts": w.PREEMPT[:1], "max_tokens": w.PREEMPT_MAX_TOKENS},  # stores the shared prefix
        {"prompts": w.PREEMPT, "max_tokens": w.PREEMPT_MAX_TOKENS},
    ]
    # 4 requests share 4 prefix blocks and need 1 more each to start, 2 by the end: 12 > 9.
    return run_engine(
        {"model": tiny_model, "kv": kv, "engine": ENGINE, "rounds": rounds}, tmp_path_factory.mktemp("pre")
    )


def test_preemption_happened(preempt_run):
    assert preempt_run["state"]["preemptions"] > 0


def test_outputs_survive_preemption_and_reload(preempt_run, preempt_baseline):
    r0, r1 = preempt_run["rounds"]
    assert outputs(r0) == preempt_baseline[:1]
    assert outputs(r1) == preempt_baseline
    assert all(n >= 512 for n in lmcache_tokens(r1))


def test_no_tracker_or_pin_outlives_preempted_requests(preempt_run):
    state = preempt_run["state"]
    assert state["request_trackers"] == 0 and state["unfinished_requests"] == 0
    assert state["pinned_chunks"] == 0 and state["pinned_requests"] == 0 and state["load_specs"] == 0
