"""KVLens's CPU tier inside real vLLM: shared prefixes come back after vLLM's cache is flushed."""

import re

import pytest

from . import workloads as w
from .conftest import cached_tokens, expected, lmcache_tokens, outputs, run_engine

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cpu_run(tiny_model, tmp_path_factory):
    kv = {"lmcache.chunk_size": 256, "lmcache.max_local_cpu_size": 0.25, "lmcache.save_unfull_chunk": True}
    rounds = [
        {"prompts": [w.A, w.SHORT]},  # cold: stores A's chunks and its unfull tail
        {"prompts": [w.A, w.B, w.SHORT]},  # vLLM's prefix cache was flushed: KVLens supplies
        {"prompts": [w.C]},
    ]
    tmp = tmp_path_factory.mktemp("cpu")
    digests = {"KVLENS_WEIGHTS_DIGESTS": str(tmp / "weights-digests.json")}  # nothing remembered yet
    return run_engine({"model": tiny_model, "kv": kv, "rounds": rounds}, tmp, env=digests)


def test_the_weights_are_hashed_during_vllms_load_and_the_scheduler_finds_them_remembered(cpu_run):
    """KVLens's vLLM plugin (connector/vllm_plugin) hashes the weight file as vLLM's loader reads
    it; the scheduler half, which starts after the load, then reads nothing."""
    log = cpu_run["log"]
    assert "KVLens weights hashed beside vLLM's load: 1 files" in log
    remembered = r"KVLens model identity ckpt:\w+ from 1 files \(.*1 digests remembered\): hashed 0\.0 GB"
    assert re.search(remembered, log)


def test_outputs_are_identical_to_vllm_without_kvlens(cpu_run, baseline):
    r0, r1, r2 = cpu_run["rounds"]
    assert outputs(r0) == expected(baseline, [w.A, w.SHORT])
    assert outputs(r1) == expected(baseline, [w.A, w.B, w.SHORT])
    assert outputs(r2) == expected(baseline, [w.C])


def test_cold_round_hits_nothing(cpu_run):
    assert lmcache_tokens(cpu_run["rounds"][0]) == [0, 0]
    assert cached_tokens(cpu_run["rounds"][0]) == [0, 0]


def test_repeated_prompt_is_served_whole_including_its_unfull_tail(cpu_run):
    a = cpu_run["rounds"][1][0]
    assert a["kv_transfer_params"]["num_lmcache_cached_tokens"] == 700
    assert a["num_cached_tokens"] == 699  # the last token is always recomputed


def test_shared_prefix_of_a_new_prompt_is_served_by_whole_chunks(cpu_run):
    b = cpu_run["rounds"][1][1]
    assert b["kv_transfer_params"]["num_lmcache_cached_tokens"] == 512
    assert b["num_cached_tokens"] >= 512
    c = cpu_run["rounds"][2][0]
    assert c["kv_transfer_params"]["num_lmcache_cached_tokens"] == 256
    assert c["num_cached_tokens"] >= 256


def test_prompt_shorter_than_a_chunk_is_served_from_its_partial_chunk(cpu_run):
    short = cpu_run["rounds"][1][2]
    assert short["kv_transfer_params"]["num_lmcache_cached_tokens"] == 200
    assert short["num_cached_tokens"] == 199


def test_nothing_is_left_tracked_or_pinned_after_the_workload(cpu_run):
    state = cpu_run["state"]
    assert state["request_trackers"] == 0 and state["load_specs"] == 0
    assert state["unfinished_requests"] == 0 and state["pinned_requests"] == 0
    assert state["pinned_chunks"] == 0 and state["failed_blocks"] == []
    assert state["tiers"]["cpu"]["chunks"] > 0


def test_vllm_calls_the_layer_hooks_so_loads_overlap_the_forward_pass(cpu_run):
    """Layer-wise copies (the default) rely on vLLM calling wait_for_layer_load and
    save_kv_layer on this platform; without them every copy would wait for the step's end."""
    calls = cpu_run["state"]["layer_hook_calls"]
    assert calls["save_layer"] > 0
    assert calls["wait_layer_with_loads"] > 0
