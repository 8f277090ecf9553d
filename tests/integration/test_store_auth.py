"""A disk tier shared under ``extra_config.store_auth_key``: an engine loads what holders of its key
stored, with vLLM's own outputs, and refuses (then recomputes and replaces) what an engine with
another key stored there."""

import pytest

from . import workloads as w
from .conftest import disk_kv, expected, lmcache_tokens, outputs, run_engine

pytestmark = pytest.mark.integration

OURS = "the-fleets-store-key-0001"
THEIRS = "someone-elses-store-key-0002"


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    disk = str(tmp_path_factory.mktemp("kvdisk-auth"))
    rounds = [{"prompts": [w.A]}, {"prompts": [w.A, w.B]}]
    ours = run_engine(
        {"model": tiny_model, "kv": disk_kv(disk, extra_config={"store_auth_key": OURS}), "rounds": rounds},
        tmp_path_factory.mktemp("auth-ours"),
    )
    rounds = [{"prompts": [w.A, w.B]}, {"prompts": [w.A, w.B]}]
    theirs = run_engine(
        {"model": tiny_model, "kv": disk_kv(disk, extra_config={"store_auth_key": THEIRS}), "rounds": rounds},
        tmp_path_factory.mktemp("auth-theirs"),
    )
    return ours, theirs


def test_records_tagged_with_the_engines_key_load_with_identical_outputs(runs, baseline):
    ours, _ = runs
    first, second = ours["rounds"]
    assert lmcache_tokens(second) == [640, 512]
    assert outputs(first) == expected(baseline, [w.A]) and outputs(second) == expected(baseline, [w.A, w.B])
    assert not ours["state"]["failed_blocks"]


def test_records_of_another_key_are_refused_recomputed_and_replaced(runs, baseline):
    _, theirs = runs
    refused, again = theirs["rounds"]
    assert theirs["state"]["failed_blocks"], "records under another key must fail to load"
    assert outputs(refused) == expected(baseline, [w.A, w.B])
    assert lmcache_tokens(again) == [640, 512] and outputs(again) == expected(baseline, [w.A, w.B])
