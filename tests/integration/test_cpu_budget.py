"""A CPU tier of a few chunks under prompts far larger than it: the index and the tier agree
after every round, and the engine's memory stays flat."""

import pytest

from . import workloads as w
from .conftest import expected, outputs, run_engine

pytestmark = pytest.mark.integration

# float32 tiny model: one 256-token chunk is 2 blocks x 4 layers x 128 KiB = 1 MiB.
CHUNK_BYTES = 1024**2
BUDGET_GB = 4 * CHUNK_BYTES / 1024**3  # four chunks; each prompt has eleven


@pytest.fixture(scope="module")
def budget_run(tiny_model, tmp_path_factory):
    kv = {"lmcache.chunk_size": 256, "lmcache.max_local_cpu_size": BUDGET_GB}
    rounds = [{"prompts": [p]} for p in w.LONG]
    return run_engine({"model": tiny_model, "kv": kv, "rounds": rounds}, tmp_path_factory.mktemp("budget"))


def test_the_tier_holds_exactly_what_the_index_says(budget_run):
    state = budget_run["state"]
    assert state["worker_cpu_bytes"] == state["index_bytes"]["cpu"]
    assert state["index_bytes"]["cpu"] <= 4 * CHUNK_BYTES


def test_memory_stays_flat_over_many_long_prompts(budget_run):
    rss = budget_run["state"]["rss_mb"]
    # Each prompt stores 11 MiB of chunks; a tier that kept them would grow by ~170 MiB. The
    # engine alone grows 10 MiB here, and up to 50 MiB in a full run with the unit tests beside
    # it (malloc arenas; 2026-12-02): 80 keeps room for that and still catches the leak.
    assert rss[-1] - rss[1] < 80, rss


def test_outputs_are_vllms_own(budget_run, baseline):
    for prompt, rnd in zip(w.LONG, budget_run["rounds"], strict=True):
        assert outputs(rnd) == expected(baseline, [prompt])
