"""Failed loads under vLLM's asynchronous scheduling, on a real engine.

On a GPU, vLLM runs with asynchronous scheduling (its default with a KV connector): the
scheduler plans step N+1 before the output of step N, and KVLens's worker report in it, has
been processed. vLLM's CPU platform turns it off, so these runs force it back on. The prompt
is long and the step budget small, so the step after the one whose load fails computes (and
would store) more of the prompt over the failed blocks before anyone knows they failed.
"""

import pytest

from . import workloads as w
from .conftest import disk_kv, lmcache_tokens, outputs, run_engine

pytestmark = pytest.mark.integration

EVERYTHING = 10**6
LONG_A = w.A + w.tokens(20, 1300)  # 2,000 tokens: the first 640 are stored by round 0
ENGINE = {"async_scheduling": True, "max_num_batched_tokens": 256, "max_num_seqs": 4}


COMMON = {"async_scheduling": True, "engine": ENGINE}


@pytest.fixture(scope="module")
def alone(tiny_model, tmp_path_factory):
    """vLLM without KVLens, same settings."""
    spec = {**COMMON, "model": tiny_model, "kv": None, "rounds": [{"prompts": [w.A]}, {"prompts": [LONG_A]}]}
    return run_engine(spec, tmp_path_factory.mktemp("b"))


# Under vLLM's recompute policy (this harness's) KVLens loads from disk outside the step either
# way (a failed load in the step would leave its blocks in vLLM's prefix cache): "setting-off"
# checks that enable_async_loading: false does too.
@pytest.fixture(scope="module", params=[False, True], ids=["setting-off", "async-loads"])
def runs(request, alone, tiny_model, tmp_path_factory):
    disk = str(tmp_path_factory.mktemp("kv-async"))
    rounds = [
        {"prompts": [w.A]},
        # Every stored chunk turns corrupt: the load of LONG_A's first 640 tokens fails while
        # the next steps go on computing the rest of the prompt over the unfilled blocks.
        {"prompts": [LONG_A], "damage": {"dir": disk, "corrupt": EVERYTHING}},
        {"prompts": [LONG_A]},  # served from what round 1 stored
        {"prompts": [LONG_A]},
    ]
    # async-loads: every load asynchronous (a lone one would otherwise load in the step)
    extra = {"extra_config": {"async_load_in_step_max_ms": 0}} if request.param else {}
    kv = disk_kv(disk, enable_async_loading=request.param, **extra)
    spec = {**COMMON, "model": tiny_model, "kv": kv, "rounds": rounds}
    return run_engine(spec, tmp_path_factory.mktemp("a")), alone


def test_the_failed_load_is_reported_and_recomputed(runs):
    kvlens, _ = runs
    by_round = kvlens["state"]["failed_blocks_by_round"]
    assert by_round[1], "the corrupt chunks must be reported as failed blocks"
    assert by_round[0] == [] and by_round[2] == [] and by_round[3] == []


def test_what_was_stored_around_the_failed_load_serves_vllms_own_output(runs):
    kvlens, alone = runs
    want_a, want_long = outputs(alone["rounds"][0]), outputs(alone["rounds"][1])
    assert outputs(kvlens["rounds"][0]) == want_a
    for rnd in kvlens["rounds"][1:]:  # round 1 recomputed the failed blocks
        assert outputs(rnd) == want_long
    # Rounds 2 and 3 load nearly the whole prompt from KVLens: seven whole chunks and the
    # tail cut to whole blocks, so a chunk stored over the failed blocks would have been used.
    assert lmcache_tokens(kvlens["rounds"][2]) == [1920]


def test_no_disk_load_runs_in_the_step_under_the_recompute_policy(runs):
    """Not even with enable_async_loading off: a failed load in the step leaves its blocks in
    vLLM's prefix cache, unfilled, for the step vLLM already planned to compute over."""
    assert runs[0]["state"]["layer_hook_calls"]["wait_layer_with_loads"] == 0


def test_nothing_is_left_pinned_or_tracked(runs):
    state = runs[0]["state"]
    assert state["pinned_chunks"] == 0 and state["pinned_requests"] == 0
    assert state["request_trackers"] == 0 and state["unfinished_requests"] == 0


# ---- several prompts sharing a prefix, every record damaged mid-record, one batch, bf16 ----
# Issue 26 item 1, as a GPU engine runs: asynchronous scheduling, default KVLens settings with a
# disk tier only. Each repetition stores four prompts sharing a 1,000-token prefix, writes
# random bytes over the middle half of every stored record (a middle layer fails its checksum
# after the layers before it were good), sends the four prompts extended by 600 tokens in one
# batch, then once more (loaded from what that round stored). Random bytes read as bf16 hold
# NaNs: left in a block that vLLM hands out again, they make the answer of whichever request
# gets it token 0 only (its attention reads the block's unused slots too), and the KV that
# request computes is NaN, stored with a valid checksum and served again. On the main of
# issue 26 every repetition gave such answers (in the damaged round, the next one, and the
# next repetition's first); two repetitions keep the run short.
REPEATS = 2
SHARED_ENGINE = {**ENGINE, "dtype": "bfloat16", "num_gpu_blocks_override": 96}
MAX_TOKENS = 16
NAN_ANSWER = [0] * MAX_TOKENS  # greedy over NaN logits


def _shared_prefix_rounds(disk: str) -> list[dict]:
    rounds = []
    for repeat in range(REPEATS):
        prefix = w.tokens(500 + repeat, 1000)
        stored = [prefix + w.tokens(600 + 10 * repeat + i, 300 + 37 * i) for i in range(4)]
        extended = [p + w.tokens(700 + 10 * repeat + i, 600) for i, p in enumerate(stored)]
        damage = {"dir": disk, "corrupt": EVERYTHING, "middle": EVERYTHING}  # half of each record
        rounds += [
            {"prompts": stored, "max_tokens": MAX_TOKENS},
            {"prompts": extended, "max_tokens": MAX_TOKENS, "damage": damage},
            {"prompts": extended, "max_tokens": MAX_TOKENS},
        ]
    return rounds


def shared_prefix_spec(model: str, disk: str) -> dict:
    # Every disk load asynchronous, as KVLens makes them under vLLM's recompute policy (the
    # harness's); on the main of issue 26 only the first repetition's were (the disk unmeasured).
    kv = disk_kv(disk, extra_config={"async_load_in_step_max_ms": 0})
    rounds = _shared_prefix_rounds(disk)
    return {"async_scheduling": True, "engine": SHARED_ENGINE, "model": model, "kv": kv, "rounds": rounds}


@pytest.fixture(scope="module")
def shared_prefix_run(tiny_model, tmp_path_factory):
    disk = str(tmp_path_factory.mktemp("kv-shared"))
    return run_engine(shared_prefix_spec(tiny_model, disk), tmp_path_factory.mktemp("a"))


def test_damage_mid_record_under_shared_prefixes_never_gives_a_garbage_answer(shared_prefix_run):
    by_round = shared_prefix_run["state"]["failed_blocks_by_round"]
    answers = [outputs(rnd) for rnd in shared_prefix_run["rounds"]]
    garbage = [(r, i) for r, rnd in enumerate(answers) for i, a in enumerate(rnd) if a == NAN_ANSWER]
    assert garbage == [], f"(round, prompt) answered over NaN KV: {garbage}"
    for repeat in range(REPEATS):
        assert by_round[3 * repeat + 1], f"repeat {repeat}: the damage must be found"
