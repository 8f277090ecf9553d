"""A disk tier that breaks mid-run (every read and write fails) and comes back: requests keep
completing with vLLM's own outputs, the tier is skipped after a few errors with one log line
instead of one per chunk, and it is used again once a probe succeeds."""

import pytest

from . import workloads as w
from .conftest import disk_kv, expected, lmcache_tokens, outputs, run_engine

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def broken_disk_run(tiny_model, tmp_path_factory):
    disk = str(tmp_path_factory.mktemp("kv-broken") / "kv")
    rounds = [
        {"prompts": [w.A]},
        # loads of A's chunks fail (kept: an I/O error is no proof of damage), stores fail
        {"prompts": [w.A_LONGER, w.B_LONGER], "break_disk": disk},
        {"prompts": [w.A, w.B]},
        {"prompts": [w.A, w.B]},
        # the tier works again; the next probe (1 s after the skip, doubling after each probe
        # that failed meanwhile) runs in this round
        {"prompts": [w.A], "restore_disk": disk, "wait_for_probe": "disk"},
        {"prompts": [w.A], "sleep_s": 0.5},
        {"prompts": [w.A]},
    ]
    spec = {"model": tiny_model, "kv": disk_kv(disk), "policy": "recompute", "rounds": rounds}
    return run_engine(spec, tmp_path_factory.mktemp("broken"))


def test_every_request_completes_with_vllms_own_output(broken_disk_run, baseline):
    for i, rnd in enumerate(broken_disk_run["rounds"]):
        batch = [w.A_LONGER, w.B_LONGER] if i == 1 else [w.A, w.B][: len(rnd)]
        assert outputs(rnd) == expected(baseline, batch)


def test_the_broken_tier_is_skipped_after_it_fails_and_logged_once(broken_disk_run):
    by_round = broken_disk_run["state"]["failed_blocks_by_round"]
    assert by_round[1], "the loads that found the broken disk fail and are recomputed"
    assert by_round[2] == [] and by_round[3] == []  # skipped: no more failing loads
    log = broken_disk_run["log"]
    assert log.count("disk tier is now skipped") == 1
    assert log.count("storing") + log.count("load failed") <= 4  # no line per chunk per step


def test_the_tier_is_used_again_once_it_works(broken_disk_run):
    assert "disk tier is now healthy" in broken_disk_run["log"]
    assert lmcache_tokens(broken_disk_run["rounds"][-1]) == [640]
    assert broken_disk_run["state"]["tiers"]["disk"]["health"] == 2
