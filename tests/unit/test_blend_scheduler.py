"""The scheduler's half of blending, driven with stand-ins (``fakes``): which prompts blend, what a
blend job loads and stores, pins, and what the workers' reports change."""

from __future__ import annotations

from connector.config.loading import load_config
from connector.engine.jobs import CPU
from connector.engine.outcomes import BlendOutcome, ChunkProblem, FailureReason, SaveSkipReason, WorkerReport
from connector.scheduler.connector_scheduler import ConnectorScheduler

from .fakes import blocks, facts, request, step

SEP = [7, 8, 9]
DOC = 300  # a whole chunk of 256 and a tail of 44


def scheduler(**extra) -> ConnectorScheduler:
    settings = {"lmcache.enable_blending": True, "lmcache.max_local_cpu_size": 1}
    settings.update({f"lmcache.{key}": value for key, value in extra.items()})
    return ConnectorScheduler(load_config(settings, env={}), facts(), blend_separators=[SEP])


def doc(n: int) -> list[int]:
    return [100 + 1000 * n + i for i in range(DOC)]


def blend_step(s: ConnectorScheduler, rid: str, tokens: list[int], local_hit: int = 0, **kw):
    """lookup, allocation and the step that schedules the prompt's last token; the plan."""
    r = request(rid, tokens, **kw)
    need = s.lookup(r, local_hit)
    s.after_alloc(r, need, blocks(0, -(-len(tokens) // 128)))
    plan = s.build_plan(
        step(new=[(r, blocks(0, -(-len(tokens) // 128)), local_hit + need)], num_scheduled={rid: 1})
    )
    return r, need, plan


def reported(s: ConnectorScheduler, rid: str, **fields) -> None:
    s.on_worker_report(WorkerReport(blends={rid: BlendOutcome(rid, **fields)}))


def test_a_prompt_without_the_separator_takes_the_prefix_path():
    s = scheduler()
    r = request("a", doc(0))
    assert s.lookup(r, 0) == 0
    assert not s.blend.pending


def test_the_first_prompt_holding_a_document_computes_it_and_stores_its_chunks():
    s = scheduler()
    tokens = doc(0) + SEP
    r, need, plan = blend_step(s, "a", tokens)
    assert need == len(tokens) - 1  # vLLM computes the last token
    (job,) = plan.blends
    assert (job.first, job.last) == (0, len(tokens) - 1)
    assert [(c.start, c.num_tokens, c.tier, c.store_to) for c in job.chunks] == [
        (0, 256, None, (CPU,)),
        (256, 44, None, (CPU,)),
    ]
    assert all(c.name in s.tiers[CPU] for c in job.chunks)  # admitted: indexed as the write lands
    assert not plan.stores  # no prefix chunk of blended KV
    assert s.state.policies["a"].save_skip_reason is SaveSkipReason.BLENDED
    reported(s, "a", tokens=len(tokens), stored=2)
    params = s.finish(r).params
    assert params["kvlens"]["blend"]["stored_chunks"] == 2


def test_a_later_prompt_finds_the_document_behind_another_prefix_and_pins_it_until_reported():
    s = scheduler()
    blend_step(s, "a", doc(0) + SEP)
    reported(s, "a")
    tokens = [1, 2, 3] + SEP + doc(0) + SEP + [4, 5]
    _, need, plan = blend_step(s, "b", tokens)
    assert need == len(tokens) - 1
    (job,) = plan.blends
    assert [(c.start, c.tier, c.store_to) for c in job.chunks] == [(6, CPU, ()), (262, CPU, ())]
    assert s.tiers[CPU].pinned_keys == 2
    reported(s, "b", reused_by_tier={CPU: DOC})
    assert s.tiers[CPU].pinned_keys == 0


def test_a_chunk_a_worker_found_damaged_leaves_the_index():
    s = scheduler()
    _, _, first = blend_step(s, "a", doc(0) + SEP)
    reported(s, "a")
    bad = first.blends[0].chunks[0].name
    blend_step(s, "b", [1] + SEP + doc(0))
    reported(s, "b", problems=[ChunkProblem(CPU, bad, FailureReason.CORRUPT)])
    assert bad not in s.tiers[CPU]


def test_short_segments_and_prompts_the_prefix_chunks_cover_do_not_blend():
    s = scheduler(blend_min_tokens=400)
    r = request("a", doc(0) + SEP + doc(1))
    assert s.lookup(r, 0) == 0  # both documents shorter than blend_min_tokens
    s = scheduler()
    r = request("b", doc(0) + SEP)
    assert s.lookup(r, len(r.prompt_token_ids) - 1) == 0  # vLLM holds all but the last token


def test_an_abort_before_the_report_keeps_the_pins_until_the_report():
    s = scheduler()
    blend_step(s, "a", doc(0) + SEP)
    reported(s, "a")
    r, _, _ = blend_step(s, "b", [1] + SEP + doc(0))
    r.status = type("S", (), {"name": "FINISHED_ABORTED"})()
    s.finish(r)
    assert s.tiers[CPU].pinned_keys == 2  # the workers may be reading them in this very step
    reported(s, "b")
    assert s.tiers[CPU].pinned_keys == 0
    assert "b" not in s.blend.details and not s.blend.awaiting  # nothing kept for a gone response


def test_a_preempted_blend_blends_again_and_still_stores():
    s = scheduler()
    r, _, first = blend_step(s, "a", doc(0) + SEP)
    s.on_worker_report(WorkerReport(blends={"a": BlendOutcome("a", failed="preempted before")}))
    for chunk in first.blends[0].chunks:
        s.state.forget(CPU, chunk.name, FailureReason.MISSING)  # its writes never landed
    _, _, again = blend_step(s, "a", doc(0) + SEP)  # vLLM looks a resumed request up again
    assert [c.store_to for c in again.blends[0].chunks] == [(CPU,), (CPU,)]


def test_a_lookup_vllm_does_not_allocate_releases_its_pins():
    s = scheduler()
    blend_step(s, "a", doc(0) + SEP)
    reported(s, "a")
    r = request("b", [1] + SEP + doc(0))
    assert s.lookup(r, 0) > 0
    assert s.tiers[CPU].pinned_keys == 2
    s.after_alloc(r, 0, None)  # vLLM could not allocate: it asks again later
    assert s.tiers[CPU].pinned_keys == 0 and not s.blends("b")


def test_a_prompt_of_separators_only_takes_the_prefix_path():
    s = scheduler()
    assert s.lookup(request("a", SEP * 100), 0) == 0 and not s.blend.pending


def test_a_document_stored_under_another_salt_is_not_found():
    s = scheduler()
    blend_step(s, "a", doc(0) + SEP)
    reported(s, "a")
    r = request("b", [1] + SEP + doc(0), cache_salt="tenant-b")
    s.lookup(r, 0)
    assert [tier for _, tier in s.blend.pending["b"].chunks] == [None, None]  # computed, stored anew


def test_blend_tokens_are_counted_per_tenant_even_when_the_report_comes_after_the_end():
    s = scheduler()
    blend_step(s, "a", doc(0) + SEP)
    reported(s, "a", tokens=DOC + 3, recomputed=DOC + 3)
    r, _, _ = blend_step(s, "b", [1] + SEP + doc(0) + SEP + [2], cache_salt="team-b")
    s.finish(r)  # vLLM ends the request before its step's report is read
    s.take_done()
    reported(s, "b", tokens=DOC + 8, reused_by_tier={CPU: DOC}, recomputed=8)
    usage = s.take_tenant_usage().blend_tokens
    team = next(label for label, _ in usage if label != "default")
    assert team.startswith("salt:")
    assert usage == {
        ("default", "reused"): 0,
        ("default", "recomputed"): DOC + 3,
        (team, "reused"): DOC,
        (team, "recomputed"): 8,
    }
    assert s.take_tenant_usage().blend_tokens == {}  # counters: since the last take


def test_the_request_logs_summary_carries_the_blend_even_when_its_report_comes_after_the_end():
    s = scheduler()
    r, _, _ = blend_step(s, "a", doc(0) + SEP)
    reported(s, "a", tokens=DOC + 3, recomputed=DOC + 3, stored=2)
    s.finish(r)  # reported, then ended
    (early,) = s.take_done()
    assert early.blend["stored_chunks"] == 2
    r, _, _ = blend_step(s, "b", [1] + SEP + doc(0) + SEP + [2])
    s.finish(r)  # ended, then reported (same step's output)
    assert s.take_done() == []  # held for its blend's report
    reported(s, "b", tokens=DOC + 8, reused_by_tier={CPU: DOC}, recomputed=8)
    (late,) = s.take_done()
    assert late.request_id == "b" and late.blend["reused_tokens"] == {CPU: DOC}
    r, _, _ = blend_step(s, "c", [1] + SEP + doc(0) + SEP + [3])
    s.finish(r)
    for _ in range(8):  # its report never comes: logged without it, nothing left behind
        s.step_done()
    (lost,) = s.take_done()
    assert lost.request_id == "c" and lost.blend is None
    reported(s, "c", tokens=DOC + 8)  # later still: nothing waits for it any more
    assert not (s.blend.held or s.blend.for_log or s.blend.awaiting or s.blend.details or s.blend.running)
    r = request("d", doc(5))  # a request that does not blend has no blend in its line
    s.lookup(r, 0)
    s.finish(r)
    assert [x.blend for x in s.take_done()] == [None]
