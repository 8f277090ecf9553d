"""Prefill time saved is priced once the engine's cost per token is known (issue 26, item 11).

The workload of the issue, driven through the scheduler half with a clock: ten cold prompts of
equal length, then thirty hits of the same documents, one request at a time. Equal prompts
keep prefill, loads and the step overhead collinear in the step fit; the cold requests' own
prefill time (their step, alone) prices the loaded tokens meanwhile.
"""

import pytest

from connector.config.loading import load_config
from connector.engine.outcomes import WorkerReport
from connector.engine.prefill_cost import PrefillCostMeter
from connector.scheduler.connector_scheduler import ConnectorScheduler

from .fakes import blocks, facts, request, step
from .test_insight import Clock
from .test_scheduler import loaded

DOC_TOKENS = 1000
PER_TOKEN_S = 0.00049  # what a prefill token costs the simulated engine
OVERHEAD_S = 0.004  # per step
DECODE_S = 0.015  # per decode token
LOAD_S = 0.00001  # per loaded token


def _docs() -> list[list[int]]:
    return [[10_000 * (d + 1) + i for i in range(DOC_TOKENS)] for d in range(10)]


def _serve(s: ConnectorScheduler, clock: Clock, rid: str, tokens: list[int], max_tokens: int) -> None:
    """One request alone: lookup, its prefill step (loading what KVLens has), its decodes."""
    clock.now += 2.0  # idle between requests
    r = request(rid, tokens)
    r.num_computed_tokens = 0
    need = s.lookup(r, 0)
    s.after_alloc(r, need)
    r.num_computed_tokens = need
    plan = s.build_plan(step(new=[(r, blocks(0, 8), need)], num_scheduled={rid: DOC_TOKENS - need}))
    loads = sum(c.num_tokens for j in plan.loads for c in j.chunks)
    clock.now += OVERHEAD_S + PER_TOKEN_S * (DOC_TOKENS - need) + LOAD_S * loads
    if plan.loads:
        s.on_worker_report(WorkerReport(loads={rid: loaded(plan.loads[0])}))
    r.num_computed_tokens = DOC_TOKENS
    for _ in range(max_tokens - 1):
        r.all_token_ids.append(7)
        r.num_tokens += 1
        s.build_plan(step(cached=[(rid, None, r.num_computed_tokens, False)], num_scheduled={rid: 1}))
        clock.now += OVERHEAD_S + DECODE_S
        r.num_computed_tokens += 1
    s.finish(r)


@pytest.mark.parametrize("max_tokens", [1, 4, 16])
def test_hits_of_equal_cold_prompts_served_one_at_a_time_are_priced(max_tokens):
    clock = Clock()
    s = ConnectorScheduler(load_config({"lmcache.max_local_cpu_size": 1}, env={}), facts(), clock)
    docs = _docs()
    saved = 0.0
    for i, doc in enumerate(docs):
        _serve(s, clock, f"cold-{i}", doc, max_tokens)
        saved += sum(s.take_saved_seconds().values())
    for i in range(30):
        _serve(s, clock, f"hit-{i}", docs[i % 10], max_tokens)
        saved += sum(s.take_saved_seconds().values())
    cost = s.insight.prefill_cost.seconds_per_token
    assert cost is not None and PER_TOKEN_S <= cost < 2 * PER_TOKEN_S
    hits_loaded = 30 * 896  # three chunks and a whole-block tail each
    assert saved == pytest.approx(hits_loaded * cost, rel=0.25)


def test_a_cold_request_alone_measures_its_prefill_even_with_one_output_token():
    m = PrefillCostMeter()
    for i in range(3):
        m.step(10.0 * i, 1000, 1000, [f"r{i}"], cold_prompt=True)
        assert m.seconds_per_token is None or i == 2
        m.finished(10.0 * i + 0.5, f"r{i}")  # its only step took 0.5 s
    assert m.seconds_per_token == pytest.approx(0.0005)


def test_batched_or_warm_steps_do_not_count_as_a_cold_requests_prefill():
    m = PrefillCostMeter()
    for i in range(5):
        m.step(10.0 * i, 2000, 2000, [f"a{i}", f"b{i}"], cold_prompt=True)  # two requests together
        m.finished(10.0 * i + 0.5, f"a{i}")
        m.step(10.0 * i + 1, 200, 200, [f"c{i}"], loaded_tokens=800)  # a hit
        m.finished(10.0 * i + 1.2, f"c{i}")
    assert m.cold_requests == 0 and m.seconds_per_token is None
