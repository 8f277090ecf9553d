"""Damaged chunks between lookup and load, at the product's default settings.

A failed load must cost one recompute: the KV vLLM computes in that step over the unfilled
blocks is never stored, every chunk of the damaged prefix that can no longer be trusted leaves
the index, and the recompute stores good copies that later requests load without failing.
"""

import pytest

from . import workloads as w
from .conftest import disk_kv, expected, lmcache_tokens, outputs, run_engine

pytestmark = pytest.mark.integration

EVERYTHING = 10**6


@pytest.fixture(scope="module")
def recompute_run(tiny_model, tmp_path_factory):
    disk = str(tmp_path_factory.mktemp("kv-heal"))
    longer = [w.A_LONGER, w.B_LONGER]
    rounds = [
        {"prompts": [w.A, w.B]},
        # Every stored chunk turns corrupt; the same prefixes come back extended, so the
        # step that finds the damage also computes (and would store) the extensions.
        {"prompts": longer, "damage": {"dir": disk, "corrupt": EVERYTHING}},
        {"prompts": longer},
        {"prompts": longer},
    ]
    spec = {"model": tiny_model, "kv": disk_kv(disk), "policy": "recompute", "rounds": rounds}
    return run_engine(spec, tmp_path_factory.mktemp("heal"))


def test_every_round_gives_vllms_own_output(recompute_run, baseline):
    r0, *later = recompute_run["rounds"]
    assert outputs(r0) == expected(baseline, [w.A, w.B])
    for rnd in later:
        assert outputs(rnd) == expected(baseline, [w.A_LONGER, w.B_LONGER])


def test_only_the_round_that_found_the_damage_fails(recompute_run):
    by_round = recompute_run["state"]["failed_blocks_by_round"]
    assert by_round[1], "the corrupt chunks must be reported as failed blocks"
    assert by_round[0] == [] and by_round[2] == [] and by_round[3] == []


def test_the_recompute_stored_good_copies_that_are_served_again(recompute_run):
    # 1000 tokens: three whole chunks and a 232-token tail stored cut to one block (896);
    # 900 tokens: three chunks and a 132-token tail cut to one block (896).
    assert lmcache_tokens(recompute_run["rounds"][2]) == [896, 896]
    assert lmcache_tokens(recompute_run["rounds"][3]) == [896, 896]


@pytest.fixture(scope="module")
def fail_policy_run(tiny_model, tmp_path_factory):
    """vLLM's default policy: the request that finds the damage fails, the next ones do not."""
    disk = str(tmp_path_factory.mktemp("kv-heal-fail"))
    rounds = [
        {"prompts": [w.A]},
        {"prompts": [w.A], "damage": {"dir": disk, "corrupt": EVERYTHING}},
        {"prompts": [w.A]},
        {"prompts": [w.A]},
    ]
    spec = {"model": tiny_model, "kv": disk_kv(disk), "policy": "fail", "rounds": rounds}
    return run_engine(spec, tmp_path_factory.mktemp("heal-fail"))


def test_fail_policy_fails_only_the_request_that_found_the_damage(fail_policy_run, baseline):
    r0, r1, r2, r3 = fail_policy_run["rounds"]
    assert r1[0]["finish_reason"] == "error" and r1[0]["token_ids"] == []
    for rnd in (r0, r2, r3):
        assert rnd[0]["finish_reason"] != "error"
        assert outputs(rnd) == expected(baseline, [w.A])
    by_round = fail_policy_run["state"]["failed_blocks_by_round"]
    assert by_round[2] == [] and by_round[3] == []


def test_fail_policy_serves_the_prefix_from_kvlens_again(fail_policy_run):
    # Round 2 recomputes and stores everything the damage took; round 3 loads all of it.
    assert lmcache_tokens(fail_policy_run["rounds"][3]) == [640]


@pytest.fixture(scope="module")
def shared_prefix_fail_run(tiny_model, tmp_path_factory):
    """Four prompts on one prefix, admitted a few at a time (a 256-token step budget), so some
    look up after the first damaged load was reported: every record is damaged in place."""
    disk = str(tmp_path_factory.mktemp("kv-heal-four"))
    prompts = w.SHARED_FOUR
    rounds = [
        {"prompts": prompts},
        {"prompts": prompts, "damage": {"dir": disk, "corrupt": EVERYTHING}},
        {"prompts": prompts},
        {"prompts": prompts},
    ]
    spec = {
        "model": tiny_model,
        "kv": disk_kv(disk),
        "policy": "fail",
        "engine": {"max_num_batched_tokens": 256, "max_num_seqs": 4},
        "rounds": rounds,
    }
    return run_engine(spec, tmp_path_factory.mktemp("heal-four"))


def test_damage_in_place_fails_requests_in_one_round_only(shared_prefix_fail_run):
    """The chunks of requests that did not find the damage themselves (they looked up after
    the shared prefix was forgotten) are verified at once, not found by the next round."""
    errors = [sum(o["finish_reason"] == "error" for o in rnd) for rnd in shared_prefix_fail_run["rounds"]]
    assert errors[0] == 0 and errors[1] > 0, errors
    assert errors[2:] == [0, 0], errors
    by_round = shared_prefix_fail_run["state"]["failed_blocks_by_round"]
    assert by_round[2] == [] and by_round[3] == []
    assert all(lmcache_tokens(shared_prefix_fail_run["rounds"][3]))  # served from KVLens again


def test_no_pins_or_trackers_are_left(recompute_run, fail_policy_run):
    for run in (recompute_run, fail_policy_run):
        state = run["state"]
        assert state["pinned_chunks"] == 0 and state["pinned_requests"] == 0
        assert state["request_trackers"] == 0 and state["unfinished_requests"] == 0
