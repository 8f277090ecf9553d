"""The local-disk tier alone, including loads that fail between lookup and load."""

import os

import pytest

from connector.tiers.disk import USE_MARK_PREFIX

from . import workloads as w
from .conftest import disk_kv, expected, lmcache_tokens, outputs, run_engine

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("kvdisk"))


@pytest.fixture(scope="module")
def disk_run(tiny_model, tmp_path_factory, disk_dir):
    kv = disk_kv(disk_dir)
    rounds = [
        {"prompts": [w.A]},
        {"prompts": [w.A, w.B]},
        # Between lookup and load, one chunk file turns corrupt and another vanishes.
        {"prompts": [w.A, w.B], "damage": {"dir": disk_dir, "corrupt": 1, "delete": 1}},
        {"prompts": [w.A, w.B]},
    ]
    return run_engine({"model": tiny_model, "kv": kv, "rounds": rounds}, tmp_path_factory.mktemp("disk"))


def test_disk_tier_supplies_prefixes_with_identical_outputs(disk_run, baseline):
    rounds = disk_run["rounds"]
    assert lmcache_tokens(rounds[0]) == [0]
    # A's 188-token tail is stored cut to one whole block; B's 88-token tail is under a block.
    assert lmcache_tokens(rounds[1]) == [640, 512]
    for r in rounds:
        assert outputs(r) == expected(baseline, [w.A, w.B][: len(r)])


def test_chunk_files_are_whole_records(disk_run, disk_dir):
    from connector.scheduler.tenant_id_key import KEY_NAME as TENANT_ID_KEY
    from connector.tiers.store_records import NAMESPACE_DIR

    files = [f for folder, _, names in os.walk(disk_dir) if NAMESPACE_DIR not in folder for f in names]
    # chunk records and the marks of loads (no temp files left)
    assert files and all(f.endswith(".kvlens") or f.startswith(USE_MARK_PREFIX) for f in files)
    kept = os.listdir(os.path.join(disk_dir, NAMESPACE_DIR))
    assert TENANT_ID_KEY in kept  # the deployment's key for tenant ids, kept with the cache
    assert sorted(set(kept) - {"marks", TENANT_ID_KEY}) == [f"{s}.json" for s in _stored_namespaces(disk_dir)]


def _stored_namespaces(disk_dir):
    from connector.tiers.store_records import DiskRecords

    return sorted({r.namespace for r in DiskRecords(disk_dir).chunks()})


def test_failed_loads_are_reported_and_recomputed_without_leaks(disk_run, baseline):
    state = disk_run["state"]
    assert state["failed_blocks"], "the damaged chunks must be reported as failed blocks"
    assert "Recovered from KV load failure" in disk_run["log"]
    assert outputs(disk_run["rounds"][2]) == expected(baseline, [w.A, w.B])
    assert state["pinned_chunks"] == 0 and state["pinned_requests"] == 0
    assert state["request_trackers"] == 0 and state["unfinished_requests"] == 0


def test_recomputed_chunks_are_stored_again(disk_run):
    assert lmcache_tokens(disk_run["rounds"][3]) == [640, 512]


@pytest.fixture(scope="module")
def fail_policy_run(tiny_model, tmp_path_factory):
    """Under vLLM's default policy a failed load fails the request; it never returns wrong text."""
    disk = str(tmp_path_factory.mktemp("kvdisk-fail"))
    kv = disk_kv(disk)
    rounds = [
        {"prompts": [w.A]},
        {"prompts": [w.A], "damage": {"dir": disk, "corrupt": 2}},
        {"prompts": [w.A]},
    ]
    spec = {"model": tiny_model, "kv": kv, "policy": "fail", "rounds": rounds}
    return run_engine(spec, tmp_path_factory.mktemp("disk-fail"))


def test_fail_policy_fails_the_request_visibly_and_recovers(fail_policy_run, baseline):
    r0, r1, r2 = fail_policy_run["rounds"]
    assert r1[0]["finish_reason"] == "error" and r1[0]["token_ids"] == []
    assert fail_policy_run["state"]["failed_blocks"]
    # The corrupt chunks left the index: the next request recomputes and stores them again.
    assert outputs(r2) == expected(baseline, [w.A])
    assert fail_policy_run["state"]["pinned_chunks"] == 0
    assert fail_policy_run["state"]["request_trackers"] == 0
