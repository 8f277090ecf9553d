"""The scheduler's answers to "why did this request miss", "how big should the tier be",
"which instances can share" and "what did the cache save" (pure: stand-ins for vLLM)."""

from __future__ import annotations

import pytest

from connector.engine.jobs import CPU
from connector.engine.keys import Namespace, first_chunk_fingerprint
from connector.engine.namespaces import FirstChunkNamespaces, namespace_differences
from connector.engine.outcomes import MissReason, WorkerReport
from connector.engine.prefill_cost import PrefillCostMeter

from .fakes import BLOCK_BYTES, LAYERS, admit_fully, blocks, cpu_gb, request, scheduler, step
from .test_scheduler import PROMPT, loaded


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- why did it miss --------------------------------------------------------------------
def test_an_evicted_miss_says_from_which_tier_and_how_long_ago(monkeypatch):
    s = scheduler(max_local_cpu_size=cpu_gb(2 * BLOCK_BYTES * LAYERS))  # one chunk
    clock = Clock()
    s.recently_evicted._clock = clock
    admit_fully(s, request("a", PROMPT[:256] + [1]), blocks(0, 3))
    admit_fully(s, request("b", list(range(7000, 7257))), blocks(10, 3))  # evicts a's chunk
    clock.now += 42.0
    c = request("c", PROMPT)
    s.lookup(c, 0)
    assert s.lookups["c"].miss_reason is MissReason.EVICTED
    assert s.lookups["c"].miss_detail == {"tier": CPU, "evicted_s_ago": 42.0}
    params = s.finish(c).params
    assert params["kvlens"]["miss_detail"] == {"tier": CPU, "evicted_s_ago": 42.0}


def test_a_prompt_stored_under_another_cache_salt_is_other_namespace_not_never_stored():
    s = scheduler()
    admit_fully(s, request("a", PROMPT, cache_salt="tenant-1"), blocks(0, 5))
    s.lookup(request("b", PROMPT, cache_salt="tenant-2"), 0)
    assert s.lookups["b"].miss_reason is MissReason.OTHER_NAMESPACE
    assert s.lookups["b"].miss_detail == {"differs_in": ["cache_salt"]}  # names, never the salt
    s.lookup(request("c", PROMPT, kv_transfer_params={"lmcache.tag.user": "x"}), 0)
    assert s.lookups["c"].miss_reason is MissReason.OTHER_NAMESPACE
    assert s.lookups["c"].miss_detail == {"differs_in": ["cache_salt", "tags"]}
    s.lookup(request("d", [5] * 600), 0)  # other tokens: plainly never stored
    assert s.lookups["d"].miss_reason is MissReason.NOT_STORED


def test_a_request_that_only_skips_save_is_not_remembered_as_storing():
    s = scheduler()
    admit_fully(
        s, request("a", PROMPT, cache_salt="x", kv_transfer_params={"lmcache.skip_save": True}), blocks(0, 5)
    )
    s.lookup(request("b", PROMPT), 0)
    assert s.lookups["b"].miss_reason is MissReason.NOT_STORED


def test_a_failed_load_turns_the_requests_reason_into_load_failed():
    s = scheduler()
    admit_fully(s, request("a", PROMPT), blocks(0, 5))
    b = request("b", PROMPT)
    need, plan = admit_fully(s, b, blocks(10, 5))
    assert need == 512 and s.trackers["b"].miss_reason is MissReason.PARTIAL_CHUNK
    s.on_worker_report(WorkerReport(loads={"b": loaded(plan.loads[0], fail_at=1)}))
    params = s.finish(b).params
    assert params["kvlens"]["miss_reason"] == "load_failed"
    (summary,) = [d for d in s.take_done() if d.request_id == "b"]
    assert summary.miss_reason is MissReason.LOAD_FAILED and summary.failure_reasons == ("corrupt",)


def test_namespace_memory_is_bounded_and_names_what_differs():
    mem = FirstChunkNamespaces(capacity=3)
    base = Namespace("m", "bf16", "L")
    for i in range(10):
        mem.note(bytes([i]), base)
    assert len(mem) == 3 and mem.other(bytes([0]), base.with_request(None, "s", {})) is None
    assert mem.other(bytes([9]), base.with_request(None, "s", {})) == base
    assert namespace_differences(base, Namespace("m2", "fp8", "L")) == ["model", "dtype"]
    assert first_chunk_fingerprint(list(range(100)), 256) is None


def test_namespace_memory_knows_whether_any_other_namespace_stored():
    """A lookup skips fingerprinting its prompt while one namespace stores everything."""
    mem = FirstChunkNamespaces(capacity=2, per_prompt=2)
    a, b, c = (Namespace("m", "bf16", layout) for layout in "abc")
    assert not mem.others_than(a)
    mem.note(bytes([0]), a)
    mem.note(bytes([0]), a)
    assert not mem.others_than(a) and mem.others_than(b)
    mem.note(bytes([0]), b)
    mem.note(bytes([0]), c)  # two per prompt: a is forgotten
    mem.note(bytes([1]), b)
    assert mem.other(bytes([0]), b) == c and mem.others_than(a)
    mem.note(bytes([2]), b)  # two prompts: the one c stored is forgotten
    assert not mem.others_than(b) and mem.others_than(a)
    mem = FirstChunkNamespaces(per_prompt=1)
    mem.note(bytes([0]), a)
    mem.note(bytes([0]), b)  # replaces a
    assert not mem.others_than(b)


# ---- request summaries (the request log) ------------------------------------------------
def test_every_finished_request_leaves_one_summary_late_loads_included():
    s = scheduler()
    admit_fully(s, request("a", PROMPT), blocks(0, 5))
    s.finish(request("a", PROMPT))
    b = request("b", PROMPT)
    need, plan = admit_fully(s, b, blocks(10, 5))
    s.finish(b)  # finished in the step that loads it: its summary waits for the report
    assert [d.request_id for d in s.take_done()] == ["a"]
    s.on_worker_report(WorkerReport(loads={"b": loaded(plan.loads[0])}))
    (summary,) = s.take_done()
    assert summary.request_id == "b" and summary.loaded_tokens == {CPU: 512}
    assert summary.prompt_tokens == 600 and summary.load_seconds is not None
    s.lookup(request("c", PROMPT), 0)  # looked up, never scheduled (aborted while waiting)
    s.finish(request("c", PROMPT))
    (unscheduled,) = s.take_done()
    assert unscheduled.request_id == "c" and unscheduled.loaded_tokens == {}
    assert not s.take_done()


# ---- how big should the tier be ---------------------------------------------------------
def test_lookups_and_stores_feed_the_whatif_curve_and_its_gauges():
    chunk = 2 * BLOCK_BYTES * LAYERS
    s = scheduler(max_local_cpu_size=cpu_gb(4 * chunk))  # four chunks
    assert s.whatif is not None and set(s.whatif.curves) == {CPU}
    prompts = [[p * 1000 + t for t in range(512)] for p in range(6)]  # 2 chunks each, 12 in all
    for round_ in range(3):
        for i, p in enumerate(prompts):
            r = request(f"r{round_}-{i}", p)
            admit_fully(s, r, blocks(0, 4))
            s.finish(r)
    s.whatif.drain()
    points = {(p.tier, p.budget_factor): p.hit_ratio for p in s.insight_snapshot().whatif}
    assert set(points) == {(CPU, f) for f in (0.125, 0.25, 0.5, 1, 2, 4, 8, 16)}
    # a cyclic scan over 12 chunks: LRU of 4 hits nothing, 16 chunks (4x) holds them all
    assert points[CPU, 1.0] == pytest.approx(0.0, abs=0.01)
    assert points[CPU, 4.0] == pytest.approx(2 / 3, abs=0.02)  # all but round 1
    s.shutdown()


def exact_lru_hit_ratio(references: list[str], capacity: int) -> float:
    """An LRU cache of ``capacity`` equal chunks, simulated: the share of references that hit."""
    from collections import OrderedDict

    cache: OrderedDict[str, None] = OrderedDict()
    hits = 0
    for key in references:
        if key in cache:
            hits += 1
            cache.move_to_end(key)
        else:
            cache[key] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits / len(references)


def test_an_idle_engine_publishes_the_whole_curve_and_its_advice_then_stops(caplog):
    chunk = 2 * BLOCK_BYTES * LAYERS
    s = scheduler(max_local_cpu_size=cpu_gb(4 * chunk))  # four chunks
    s.whatif.close()  # no feeder thread: only what the scheduler's steps feed counts
    s.whatif.min_references = 10
    prompts = [[p * 1000 + t for t in range(512)] for p in range(6)]  # 2 chunks each
    refs = []
    for round_ in range(3):
        for i, p in enumerate(prompts):
            r = request(f"r{round_}-{i}", p)
            admit_fully(s, r, blocks(0, 4))
            s.finish(r)
            refs += [f"{i}a", f"{i}b"]
    busy = {(p.tier, p.budget_factor): p.hit_ratio for p in s.insight_snapshot().whatif}
    assert busy == {}  # nothing fed while the requests ran
    steps = 0
    with caplog.at_level("INFO", logger="vllm.kvlens"):
        while s.insight_behind():  # the facade's has_pending_push_work: vLLM steps, empty
            s.build_plan(step())
            published = {p.budget_factor: p.hit_ratio for p in s.insight_snapshot().whatif}
            steps += 1
            assert steps < 5
    assert s.whatif.pending == 0 and not s.insight_behind()
    for factor, ratio in published.items():
        assert ratio == pytest.approx(exact_lru_hit_ratio(refs, int(4 * factor)), abs=0.01), factor
    assert "KVLens sizing:" in caplog.text  # the advice follows the curve it was read from


def test_a_stored_tail_is_a_reference_so_its_later_hits_count_as_hits():
    s = scheduler()
    s.whatif.close()
    prompt = list(range(9000, 9700))  # two whole chunks and a 188-token tail: one 128-token block
    for rid, first in (("a", 0), ("b", 10)):
        r = request(rid, prompt)
        admit_fully(s, r, blocks(first, 6))
        s.finish(r)
    s.whatif.drain()
    (ratio,) = {p.hit_ratio for p in s.insight_snapshot().whatif if p.budget_factor == 1.0}
    # b hit everything a stored, the tail too: half the bytes referenced were hits
    assert s.lookups == {} and ratio == pytest.approx(0.5, abs=1e-4)


def test_the_info_gauge_names_what_decides_sharing(tmp_path):
    s = scheduler(local_disk=str(tmp_path), max_local_disk_size=1)
    info = s.insight_snapshot().info
    assert info.chunk_size == 256 and len(info.key_fingerprint) == 12
    assert info.tiers == "cpu+disk" and info.role == "kv_both"
    assert info.storage.startswith("disk:") and str(tmp_path) not in info.storage
    assert (info.model_identity, info.quantization, info.kv_cache_dtype) == (
        "ckpt:0123456789abcdef",
        "none",
        "auto",
    )
    other = scheduler(local_disk=str(tmp_path), max_local_disk_size=1)
    assert other.insight_snapshot().info == info


# ---- what did it save --------------------------------------------------------------------
A, B, C, L = 0.0004, 0.0001, 0.005, 0.00002  # s per prefill, decode, loaded token; s per step


def run_steps(meter, steps, noise=0.0, seed=0):
    """Feeds busy steps (prefill, decode, loaded) that take C + A*p + B*d + L*l seconds."""
    import random

    rnd = random.Random(seed)
    t = 0.0
    for p, d, loaded_tokens in steps:
        meter.step(t, p, p + d, {"x"}, loaded_tokens)
        t += (C + A * p + B * d + L * loaded_tokens) * (1 + rnd.uniform(-noise, noise))
    meter.step(t, 0, 1, {"x"})  # closes the last one


def test_prefill_cost_is_estimated_in_mixed_batches_of_decodes_and_a_prefill():
    # 64 decodes beside a 512-token prefill (89% prefill), then decode-only steps: no step is
    # 90% prefill, so a meter of cold prefill steps only never measures anything here
    steps = [(512 if i % 4 == 0 else 0, 64 + i % 7, 0) for i in range(200)]
    meter = PrefillCostMeter()
    run_steps(meter, steps, noise=0.05)
    assert meter.seconds_per_token == pytest.approx(A, rel=0.1)


def test_prefill_cost_is_estimated_when_every_prompt_hits():
    # a warm restart: every prompt loads 512 or 768 tokens and computes its tail, beside decodes
    steps = []
    for i in range(120):
        loaded_tokens = 512 if i % 3 else 768
        steps += [((i * 37) % 200 + 8, i % 5, loaded_tokens), (0, 1 + i % 5, 0), (0, 1 + i % 5, 0)]
    meter = PrefillCostMeter()
    run_steps(meter, steps, noise=0.05)
    assert meter.seconds_per_token == pytest.approx(A, rel=0.15)


def test_prefill_cost_is_unknown_until_the_steps_pin_it_down():
    meter = PrefillCostMeter()
    run_steps(meter, [(512, 0, 0)] * 3)
    assert meter.seconds_per_token is None and meter.saved(100) is None  # too few steps
    meter = PrefillCostMeter()
    run_steps(meter, [(0, 8, 0)] * 50)
    assert meter.seconds_per_token is None  # no prefill at all
    meter = PrefillCostMeter()
    run_steps(meter, [(100 * (i % 3 + 1), 0, 500 * (i % 3 + 1)) for i in range(50)])
    assert meter.seconds_per_token is None  # prefill always in step with the loads: not separable
    meter = PrefillCostMeter()
    run_steps(meter, [(512 if i % 2 else 0, 8 if i % 2 else 0, 0) for i in range(60)], noise=3.0)
    assert meter.seconds_per_token is None  # too noisy to say


def test_equal_pure_prefill_steps_are_priced_at_their_seconds_per_token():
    meter = PrefillCostMeter()
    run_steps(meter, [(1000, 0, 0), (0, 2, 0)] * 8)
    assert meter.seconds_per_token == pytest.approx((C + A * 1000) / 1000)  # the overhead included


def test_idle_gaps_are_never_measured():
    meter = PrefillCostMeter()
    t = 0.0
    for i in range(20):
        meter.step(t, 512, 512, {f"r{i}"})
        meter.step(t + 0.2, 0, 1, {f"r{i}"})  # busy: its decode follows
        meter.step(t + 100.0, 256, 256, {f"n{i}"})  # a new request after an idle gap
        t += 200.0
    assert meter.measured_steps == 20


def test_loaded_tokens_are_priced_at_the_measured_cost_per_tier():
    clock = Clock()
    s = scheduler()
    s.state.clock = clock
    a = request("a", PROMPT)
    s.lookup(a, 0)
    s.after_alloc(a, 0)
    s.build_plan(step(new=[(a, blocks(0, 5), 0)], num_scheduled={"a": 600}))
    clock.now += 0.6  # the cold prefill of 600 tokens
    s.build_plan(step(cached=[("a", None, 600, False)], num_scheduled={"a": 1}))
    assert s.insight_snapshot().prefill_seconds_per_token is None  # one step: unknown
    for _ in range(8):
        clock.now += 0.001  # decodes
        s.build_plan(step(cached=[("a", None, 600, False)], num_scheduled={"a": 1}))
    for _ in range(8):  # more of its prompt's length in prefill: 1 ms a token
        clock.now += 0.001
        s.build_plan(step(cached=[("a", None, 600, False)], num_scheduled={"a": 600}))
        clock.now += 0.6
        s.build_plan(step(cached=[("a", None, 600, False)], num_scheduled={"a": 1}))
    assert s.insight_snapshot().prefill_seconds_per_token == pytest.approx(0.001)
    s.finish(a)
    b = request("b", PROMPT)
    need, plan = admit_fully(s, b, blocks(10, 5))
    s.on_worker_report(WorkerReport(loads={"b": loaded(plan.loads[0])}))
    assert s.take_saved_seconds() == {CPU: pytest.approx(0.512)}
    assert s.take_saved_seconds() == {}


# ---- KV-aware routing: block events ------------------------------------------------------
def _events_scheduler(**extra):
    from connector.config.loading import load_config
    from connector.engine.facts import EngineFacts
    from connector.scheduler.connector_scheduler import ConnectorScheduler

    from .fakes import BLOCK

    config = load_config({f"lmcache.{k}": v for k, v in extra.items()}, env={})
    facts = EngineFacts(
        "tiny", "bfloat16", BLOCK, LAYERS, BLOCK_BYTES, "test-layout", 1, "kv_both", kv_events=True
    )
    return ConnectorScheduler(config, facts)


def _hashed(rid, tokens):
    return request(
        rid, tokens, block_hashes=[f"{rid}-{tokens[i]}".encode() for i in range(0, len(tokens) - 127, 128)]
    )


def test_stores_and_evictions_are_block_events_with_vllms_block_hashes(tmp_path):
    from connector.engine.block_events import BlocksCleared, BlocksRemoved, BlocksStored

    chunk = 2 * BLOCK_BYTES * LAYERS
    s = _events_scheduler(
        max_local_cpu_size=cpu_gb(2 * chunk), local_disk=str(tmp_path), max_local_disk_size=1
    )
    a = _hashed("a", PROMPT)
    admit_fully(s, a, blocks(0, 5))
    events = s.block_events.take()
    assert [(e.medium, e.block_hashes, e.parent_block_hash) for e in events] == [
        ("cpu", tuple(a.block_hashes[0:2]), None),
        ("disk", tuple(a.block_hashes[0:2]), None),
        ("cpu", tuple(a.block_hashes[2:4]), a.block_hashes[1]),
        ("disk", tuple(a.block_hashes[2:4]), a.block_hashes[1]),
    ]
    assert all(isinstance(e, BlocksStored) and e.block_size == 128 for e in events)
    assert events[2].token_ids == tuple(PROMPT[256:512])
    s.finish(a)
    b = _hashed("b", list(range(5000, 5600)))
    admit_fully(s, b, blocks(10, 5))  # the CPU tier holds two chunks: a's leave it, not the disk
    events = s.block_events.take()
    removed = [e for e in events if isinstance(e, BlocksRemoved)]
    assert [(e.medium, e.block_hashes) for e in removed] == [
        ("cpu", tuple(a.block_hashes[0:2])),
        ("cpu", tuple(a.block_hashes[2:4])),
    ]
    s.reset()
    s.build_plan(step())
    first, *cleared = s.block_events.take()
    assert isinstance(first, BlocksCleared)  # routers drop the instance's blocks, then each chunk
    assert {(e.medium, e.block_hashes) for e in cleared} == {
        ("disk", tuple(a.block_hashes[0:2])),
        ("disk", tuple(a.block_hashes[2:4])),
        ("cpu", tuple(b.block_hashes[0:2])),
        ("disk", tuple(b.block_hashes[0:2])),
        ("cpu", tuple(b.block_hashes[2:4])),
        ("disk", tuple(b.block_hashes[2:4])),
    }
    assert len(s.block_events) == 0  # nothing held: nothing remembered


def test_without_kv_events_nothing_is_collected():
    s = scheduler()
    admit_fully(s, _hashed("a", PROMPT), blocks(0, 5))
    assert not s.block_events.enabled and s.block_events.take() == [] and len(s.block_events) == 0


def test_chunks_another_engine_deletes_from_a_shared_disk_are_reported_removed_and_forgotten(tmp_path):
    import time

    from connector.engine.block_events import BlocksRemoved
    from connector.scheduler.disk_sync import ScanDelta

    s = _events_scheduler(local_cpu=False, local_disk=str(tmp_path), max_local_disk_size=1)
    a = _hashed("a", PROMPT)
    admit_fully(s, a, blocks(0, 5))
    s.finish(a)
    stored = s.block_events.take()
    assert len(stored) == 2 and len(s.block_events) == 2
    watcher = s.state.disk_view._watcher  # a scan long after our writes settled sees them gone
    watcher.take()
    watcher._deltas.append(ScanDelta(time.time() + 60, removed=set(s.tiers["disk"].keys())))
    s.build_plan(step())
    removed = s.block_events.take()
    assert {(type(e), e.medium, e.block_hashes) for e in removed} == {
        (BlocksRemoved, "disk", e.block_hashes) for e in stored
    }
    assert len(s.block_events) == 0


def test_a_chunk_promoted_from_disk_into_the_cpu_tier_is_a_cpu_store_event(tmp_path):
    from connector.engine.block_events import BlocksRemoved, BlocksStored

    chunk = 2 * BLOCK_BYTES * LAYERS
    s = _events_scheduler(
        max_local_cpu_size=cpu_gb(2 * chunk), local_disk=str(tmp_path), max_local_disk_size=1
    )
    a = _hashed("a", PROMPT)
    admit_fully(s, a, blocks(0, 5))
    s.finish(a)
    admit_fully(s, _hashed("b", list(range(5000, 5600))), blocks(10, 5))  # a's chunks leave the CPU tier
    s.block_events.take()
    c = _hashed("c", PROMPT)  # a's prompt again: its chunks load from disk and are kept in the CPU tier
    need = s.lookup(c, 0)
    assert need == 512 and s.loads_async("c")  # disk hits load outside the step (the default)
    s.after_alloc(c, need, blocks(20, 5))
    plan = s.build_plan(step())
    assert [ch.promote_to for ch in plan.async_loads[0].chunks] == [("cpu",), ("cpu",)]
    events = s.block_events.take()
    stored = [(e.medium, e.block_hashes, e.parent_block_hash) for e in events if isinstance(e, BlocksStored)]
    assert (
        stored
        == [  # by the hashes vLLM gave the chunk's blocks (the same tokens: a's, in vLLM)
            ("cpu", tuple(a.block_hashes[0:2]), None),
            ("cpu", tuple(a.block_hashes[2:4]), a.block_hashes[1]),
        ]
    )
    assert all(e.medium == "cpu" for e in events if isinstance(e, BlocksRemoved))  # b's chunks made room


def test_a_chunk_only_the_remote_held_is_described_by_the_request_that_promotes_it(tmp_path):
    from connector.engine.block_events import BlockEvents

    events = BlockEvents(128, enabled=True)
    c = _hashed("c", PROMPT)
    events.promoted("x" * 32, 256, 256, c, "cpu")
    events.promoted("y" * 32, 0, 256, None, "cpu")  # no request (finished meanwhile): nothing
    (stored,) = events.take()
    assert (stored.medium, stored.block_hashes, stored.parent_block_hash) == (
        "cpu",
        tuple(c.block_hashes[2:4]),
        c.block_hashes[1],
    )
    assert stored.token_ids == tuple(PROMPT[256:512]) and len(events) == 1


def test_a_response_never_tells_one_tenant_that_another_stored_its_prompt():
    s = scheduler()
    admit_fully(s, request("a", PROMPT, cache_salt="tenant-1"), blocks(0, 5))
    b = request("b", PROMPT, cache_salt="tenant-2")
    s.lookup(b, 0)
    s.after_alloc(b, 0)
    assert s.lookups["b"].miss_reason is MissReason.OTHER_NAMESPACE  # the operator's view
    usage = s.finish(b).params["kvlens"]  # the client's: its own namespace never held it
    assert usage["miss_reason"] == "not_stored" and "miss_detail" not in usage
