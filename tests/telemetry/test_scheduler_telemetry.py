"""Scheduler-side telemetry around the real scheduler half, with stand-in vLLM requests."""

from __future__ import annotations

import json
import urllib.request
from functools import partial
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from connector.config.loading import load_config
from connector.engine.facts import EngineFacts
from connector.engine.jobs import CPU
from connector.engine.outcomes import ChunkLoadResult, FailureReason, LoadOutcome, StoreFailure, WorkerReport
from connector.engine.snapshots import KnownLabels
from connector.scheduler.connector_scheduler import ConnectorScheduler
from connector.scheduler.remote_lookup import RemoteLookup
from connector.tiers.redis_tier import RemoteUnavailable
from telemetry import tracing
from telemetry.metrics import PromRecorder
from telemetry.scheduler_recorder import SchedulerRecorder
from telemetry.settings import TelemetrySettings

from ..unit import fakes
from .serve import free_port

BLOCK, BLOCK_BYTES, LAYERS = 128, 1000, 2
PROMPT = list(range(1000, 1600))  # 600 tokens: two whole 256-token chunks and a tail
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Wired:
    """The scheduler half and its recorder, wired as the connector's facade wires them."""

    def __init__(self, sched: ConnectorScheduler, rec: SchedulerRecorder) -> None:
        self.sched, self.rec = sched, rec

    def lookup(self, req, num_computed=0):
        with self.rec.lookup(req.request_id):
            return self.sched.lookup(req, num_computed)

    def after_alloc(self, req, n):
        self.rec.lookup_final(self.sched.after_alloc(req, n))

    def report(self, report: WorkerReport):
        recomputed = self.sched.on_worker_report(report)
        self.rec.loads_reported(report.loads, recomputed, report.store_failures)
        self.rec.requests_done(self.sched.take_done())

    def finish(self, req):
        result = self.sched.finish(req)
        self.rec.finished(req.request_id, result.unscheduled_lookup)
        self.rec.requests_done(self.sched.take_done())
        return result.params

    def stats(self):
        s = self.sched
        return self.rec.stats(
            s.sizes(), s.insight_snapshot, not s.unfinished, s.take_evictions(), s.take_saved_seconds()
        )


def make(tmp_path, tracing_on=False, metrics=True, recompute=True, **env):
    config = load_config({}, env={})
    sched = ConnectorScheduler(
        config, EngineFacts("tiny", "bf16", BLOCK, LAYERS, BLOCK_BYTES, "l", 1, "kv_both")
    )
    settings = TelemetrySettings.from_env(
        None,
        {
            "KVLENS_TRACING": "1" if tracing_on else "0",
            "KVLENS_METRICS": "1" if metrics else "0",
            "KVLENS_EVENT_LOG": str(tmp_path / "events.jsonl"),
            **env,
        },
    )
    w = Wired(
        sched, SchedulerRecorder(settings, "tiny", "0", BLOCK, recompute, KnownLabels.for_tiers(("cpu",)))
    )
    return w, w


def request(rid, tokens, **kw):
    return fakes.request(rid, tokens, **{"trace_headers": None, **kw})


def step(req, block_ids, num_computed, num_scheduled):
    new = SimpleNamespace(
        req_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        block_ids=(list(block_ids),),
        num_computed_tokens=num_computed,
    )
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={req.request_id: num_scheduled},
    )


def admit(w, _tel, req, block_ids):
    """What the connector does for one request's first step; returns the step's plan."""
    need = w.lookup(req)
    w.after_alloc(req, need)
    return w.sched.build_plan(step(req, block_ids, need, req.num_tokens - need))


def finish(w, _tel, req):
    return w.finish(req)


def loaded(plan, failed=()):
    job = plan.loads[0]
    out = LoadOutcome(job.request_id, nbytes=0 if failed else 4096, seconds=0.001 if failed else 0.002)
    for i, c in enumerate(job.chunks):
        r = ChunkLoadResult(c.name, c.tier, c.num_tokens)
        if failed:
            r.reason = FailureReason.MISSING if i == 0 else FailureReason.PREFIX_FAILED
            r.detail = "gone" if i == 0 else ""
        else:
            r.tier = c.tier
        out.chunks.append(r)
    out.failed_block_ids = list(failed)
    return WorkerReport(loads={job.request_id: out})


def test_response_carries_the_kvlens_breakdown(tmp_path):
    sched, tel = make(tmp_path)
    a = request("a", PROMPT)
    admit(sched, tel, a, range(10, 15))
    params = finish(sched, tel, a)
    assert params["kvlens"]["miss_reason"] == "not_stored" and params["kvlens"]["loaded_tokens"] == {}
    b = request("b", PROMPT[:512] + [7] * 40)
    plan = admit(sched, tel, b, range(20, 25))
    tel.report(loaded(plan))
    params = finish(sched, tel, b)
    assert params["num_lmcache_cached_tokens"] == 512
    assert params["kvlens"] == {
        "vllm_cached_tokens": 0,
        "hit_tokens": 512,
        "loaded_tokens": {"cpu": 512},
        "load_ms": 2.0,
        "failed_blocks": 0,
        "recomputed_tokens": 0,
        "miss_reason": "partial_chunk",
        "save_skip_reason": None,
    }


def test_a_request_finished_before_its_load_report_still_gets_the_breakdown(tmp_path):
    """vLLM frees a one-token request before it processes that step's worker report."""
    sched, tel = make(tmp_path)
    admit(sched, tel, request("a", PROMPT), range(10, 15))
    finish(sched, tel, request("a", PROMPT))
    b = request("b", PROMPT)
    plan = admit(sched, tel, b, range(20, 25))
    params = finish(sched, tel, b)
    assert params["kvlens"]["loaded_tokens"] == {}
    tel.report(loaded(plan))  # same update_from_output, before the output is sent
    assert params["kvlens"]["loaded_tokens"] == {"cpu": 512}


def test_failed_load_is_written_to_the_event_log_and_counted(tmp_path):
    sched, tel = make(tmp_path)
    admit(sched, tel, request("a", PROMPT), range(10, 15))
    finish(sched, tel, request("a", PROMPT))
    tel.stats()
    b = request("b", PROMPT)
    plan = admit(sched, tel, b, range(20, 25))
    tel.report(loaded(plan, failed=[20, 21, 22, 23]))
    params = finish(sched, tel, b)
    assert params["kvlens"]["failed_blocks"] == 4 and params["kvlens"]["recomputed_tokens"] == 512
    (line,) = (tmp_path / "events.jsonl").read_text().splitlines()
    event = json.loads(line)
    assert event["request_id"] == "b" and event["tier"] == "cpu" and event["block_ids"] == [20, 21, 22, 23]
    assert event["tokens_affected"] == 512 and event["recomputed"] is True and "missing" in event["reason"]
    counters = tel.stats()["counters"]
    assert counters["failed_blocks|missing"] == 4 and counters["recomputed_tokens"] == 512
    assert counters["failed_chunks|load|cpu|missing"] == 1 and counters["failed_load_requests"] == 1


class TimingOutRedis:
    """The lookup client of a Redis that does not answer an existence check in time."""

    def exists_many(self, keys):
        raise RemoteUnavailable("remote exists_many failed (timeout)", op="exists_many", kind="timeout")

    def ping(self):
        return 0.001

    def connect(self):
        return 0.001

    def warm(self):
        return True

    def close(self):
        pass


def test_a_remote_lookup_that_timed_out_is_lookup_timeout_not_not_stored(tmp_path):
    """The local tiers supply the prompt's first chunks; the next one needed the remote's answer,
    which did not come in time: response, request log and miss counter say lookup_timeout."""
    log = tmp_path / "requests.jsonl"
    sched, tel = make(tmp_path, KVLENS_REQUEST_LOG=str(log))
    admit(sched, tel, request("a", PROMPT), range(10, 15))
    finish(sched, tel, request("a", PROMPT))
    state = sched.sched.state
    state.remote = RemoteLookup(TimingOutRedis(), 1)
    try:
        longer = request("b", PROMPT[:512] + list(range(5000, 5300)))  # chunk 3 is the remote's to say
        cold = request("c", list(range(7000, 7600)))  # nothing local: the remote's answer was all
        plans = [
            admit(sched, tel, req, blocks) for req, blocks in ((longer, range(20, 27)), (cold, range(30, 35)))
        ]
        assert [len(plan.loads) for plan in plans] == [1, 0]  # the local prefix is still loaded
        params = [finish(sched, tel, req) for req in (longer, cold)]
        tel.report(loaded(plans[0]))  # b's line waits for its load
    finally:
        state.remote.close()
    assert [p["kvlens"]["miss_reason"] for p in params] == ["lookup_timeout", "lookup_timeout"]
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["miss_reason"] for x in lines] == ["not_stored", "lookup_timeout", "lookup_timeout"]
    counters = tel.stats()["counters"]
    assert counters["miss_requests|lookup_timeout"] == 2 and counters["miss_requests|not_stored"] == 1


def test_lookup_metrics_and_gauges_return_to_zero_when_drained(tmp_path, monkeypatch):
    monkeypatch.setattr("telemetry.scheduler_recorder.GAUGE_INTERVAL_S", 0.0)
    sched, tel = make(tmp_path)
    a = request("a", PROMPT)
    admit(sched, tel, a, range(10, 15))
    first = tel.stats()
    assert first["counters"]["lookup_requests"] == 1 and first["counters"]["lookup_tokens"] == 600
    assert first["counters"]["miss_requests|not_stored"] == 1
    assert first["gauges"]["request_trackers"] == 1 and first["gauges"]["tier_chunks|cpu|"] == 2
    assert len(first["histograms"]["operation_seconds|lookup"]) == 1
    finish(sched, tel, a)
    b = request("b", PROMPT)
    plan = admit(sched, tel, b, range(20, 25))
    during = tel.stats()
    assert during["gauges"]["pinned_chunks|cpu"] == 2 and during["counters"]["hit_tokens|cpu"] == 512
    tel.report(loaded(plan))
    finish(sched, tel, b)
    drained = tel.stats()["gauges"]
    for key in (
        "request_trackers",
        "unfinished_requests",
        "pinned_requests",
        "pinned_chunks|cpu",
        "pinned_bytes|cpu",
        "load_specs",
        "telemetry_open_requests",
    ):
        assert drained.get(key, 0) == 0, key
    assert tel.stats() is None  # nothing changed since: nothing to ship


def test_request_never_scheduled_gets_its_lookup_span_at_finish(tmp_path, spans):
    sched, tel = make(tmp_path, tracing_on=True)
    a = request("a", PROMPT, trace_headers={"traceparent": TRACEPARENT})
    for _ in range(3):  # vLLM asks again each step while the request waits
        tel.lookup(a)
    finish(sched, tel, a)
    (span,) = spans.get_finished_spans()
    assert span.name == "kvlens.lookup"
    assert span.attributes[tracing.A_ATTEMPTS] == 3 and span.attributes[tracing.A_SCHEDULED] is False
    assert format(span.context.trace_id, "032x") == TRACEPARENT[3:35]


def test_lookup_span_attributes_and_trace_context_reaches_the_plan(tmp_path, spans):
    sched, tel = make(tmp_path, tracing_on=True)
    headers = {"traceparent": TRACEPARENT}
    a = request("a", PROMPT, trace_headers=headers)
    plan = admit(sched, tel, a, range(10, 15))
    assert plan.stores and all(j.trace_context == headers for j in plan.stores)
    finish(sched, tel, a)
    b = request("b", PROMPT, trace_headers=headers)
    plan = admit(sched, tel, b, range(20, 25))
    assert plan.loads[0].trace_context == headers
    span = spans.get_finished_spans()[-1]
    attrs = span.attributes
    assert span.name == "kvlens.lookup" and attrs[tracing.A_REQUEST_ID] == "b"
    assert attrs[tracing.A_PROMPT_TOKENS] == 600 and attrs[tracing.A_HIT_TOKENS] == 512
    assert attrs[tracing.A_VLLM_CACHED_TOKENS] == 0 and attrs[tracing.A_EXTERNAL_TOKENS] == 512
    assert list(attrs[tracing.A_TIERS]) == ["cpu"] and attrs[tracing.A_CHUNKS] == 2
    assert attrs[tracing.A_MISS_REASON] == "partial_chunk"
    assert not any(isinstance(v, (list, tuple)) and len(v) > 8 for v in attrs.values())  # no token ids


def test_with_telemetry_off_lookups_are_not_timed_and_nothing_is_shipped(tmp_path, spans):
    sched, tel = make(tmp_path, tracing_on=False, metrics=False)
    a = request("a", PROMPT, trace_headers={"traceparent": TRACEPARENT})
    admit(sched, tel, a, range(10, 15))
    assert not tel.rec._timings
    assert tel.stats() is None and not spans.get_finished_spans()
    assert "kvlens" in finish(sched, tel, a)  # the response breakdown is not telemetry


def test_evictions_are_counted_per_tier(tmp_path):
    sched, tel = make(tmp_path)
    index = sched.sched.tiers[CPU]
    index.evictions += 3
    assert tel.stats()["counters"]["evictions|cpu"] == 3
    assert "evictions|cpu" not in (tel.stats() or {}).get("counters", {})


def test_offline_exporter_serves_scheduler_and_worker_metrics_on_localhost(tmp_path):
    port = free_port()
    sched, tel = make(tmp_path, metrics=False, KVLENS_METRICS_PORT=str(port))
    try:
        admit(sched, tel, request("a", PROMPT), range(10, 15))
        assert tel.stats() is None  # not handed to vLLM: only the exporter gets it
        tel.rec.on_worker_stats({"counters": {"store_tokens|cpu": 512}})
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'vllm:kvlens_lookup_requests_total{engine="0",model_name="tiny"} 1.0' in text
        assert 'vllm:kvlens_store_tokens_total{engine="0",model_name="tiny",tier="cpu"} 512.0' in text
        assert 'vllm:kvlens_request_trackers{engine="0",model_name="tiny"} 1.0' in text
    finally:
        tel.rec.shutdown()


def test_gauges_are_sampled_at_intervals_while_busy_and_exactly_when_idle(tmp_path, monkeypatch):
    monkeypatch.setattr("telemetry.scheduler_recorder.GAUGE_INTERVAL_S", 3600.0)
    sched, tel = make(tmp_path)
    a = request("a", PROMPT)
    admit(sched, tel, a, range(10, 15))
    assert tel.stats()["gauges"]["request_trackers"] == 1  # first sample
    admit(sched, tel, request("b", PROMPT[:300]), range(20, 23))
    busy = tel.stats()
    assert busy["counters"]["lookup_requests"] == 1 and busy["gauges"] == {}  # not sampled yet
    finish(sched, tel, a)
    finish(sched, tel, request("b", PROMPT[:300]))
    assert tel.stats()["gauges"]["request_trackers"] == 0  # nothing runs: sampled at once


def test_a_busy_exporter_port_does_not_stop_the_engine(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        sched, tel = make(tmp_path, KVLENS_METRICS_PORT=str(busy.getsockname()[1]))
        admit(sched, tel, request("a", PROMPT), range(10, 15))
        assert tel.stats()["counters"]["lookup_requests"] == 1  # vLLM's path still works
        tel.rec.shutdown()


def test_a_resumed_request_is_counted_once(tmp_path, monkeypatch):
    w, _ = make(tmp_path)
    a = request("a", PROMPT)
    admit(w, w, a, range(10, 15))
    w.stats()
    # Preempted: vLLM looks it up again and resumes it with new blocks.
    need = w.lookup(a)
    w.after_alloc(a, need)
    counters = (w.stats() or {}).get("counters", {})
    assert "lookup_requests" not in counters and "lookup_tokens" not in counters


def test_store_failures_are_counted_by_tier_and_reason(tmp_path):
    w, _ = make(tmp_path)
    w.stats()
    w.report(
        WorkerReport(
            store_failures=[
                StoreFailure("a", "x" * 32, "disk", FailureReason.QUEUE_FULL),
                StoreFailure("a", "y" * 32, "cpu", FailureReason.DEPENDENCY_FAILED),
            ]
        )
    )
    counters = w.stats()["counters"]
    assert counters["failed_chunks|store|disk|queue_full"] == 1
    assert counters["failed_chunks|store|cpu|dependency_failed"] == 1


def test_request_log_has_one_line_per_finished_request_with_its_explanation(tmp_path):
    log = tmp_path / "requests.jsonl"
    sched, tel = make(tmp_path, KVLENS_REQUEST_LOG=str(log))
    a = request("a", PROMPT, trace_headers={"traceparent": TRACEPARENT})
    admit(sched, tel, a, range(10, 15))
    finish(sched, tel, a)
    b = request("b", PROMPT)
    plan = admit(sched, tel, b, range(20, 25))
    finish(sched, tel, b)  # its load is reported after it finished
    tel.report(loaded(plan, failed=[22, 23]))
    c = request("c", PROMPT, cache_salt="other-tenant")
    admit(sched, tel, c, range(30, 35))
    finish(sched, tel, c)
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["request_id"] for x in lines] == ["a", "b", "c"]
    first, second, third = lines
    assert first["miss_reason"] == "not_stored" and first["kvlens_tokens"] == 0
    assert first["computed_tokens"] == 600 and first["stored_chunks"] == 2
    assert first["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736" and first["lookup_ms"] >= 0
    assert second["miss_reason"] == "load_failed" and second["failed"] is True
    assert second["failure_reasons"] == ["missing"] and second["load_ms"] is not None
    assert third["miss_reason"] == "other_namespace" and third["miss_detail"] == {
        "differs_in": ["cache_salt"]
    }
    text = log.read_text()
    assert "1000, 1001" not in text and "other-tenant" not in text  # no tokens, no salt
    assert [x["blend"] for x in lines] == [None, None, None]  # none of them blended


def test_a_blended_requests_line_carries_its_blend(tmp_path):
    from connector.engine.outcomes import RequestSummary

    log = tmp_path / "requests.jsonl"
    _, tel = make(tmp_path, KVLENS_REQUEST_LOG=str(log))
    blend = {"tokens": 700, "reused_tokens": {"cpu": 600}, "recomputed_tokens": 190}
    summary = RequestSummary("a", 700, 0, {}, None, None, None, 0, 0, (), None, blend=blend)
    tel.rec.requests_done([summary])
    (line,) = [json.loads(x) for x in log.read_text().splitlines()]
    assert line["blend"] == blend


def test_request_log_off_writes_nothing_and_keeps_no_state(tmp_path):
    sched, tel = make(tmp_path)
    a = request("a", PROMPT)
    admit(sched, tel, a, range(10, 15))
    finish(sched, tel, a)
    assert not list(tmp_path.glob("*requests*")) and not tel.rec._lookup_ms


def test_prefill_seconds_saved_are_counted_per_tier(tmp_path, monkeypatch):
    monkeypatch.setattr("telemetry.scheduler_recorder.GAUGE_INTERVAL_S", 0.0)
    sched, tel = make(tmp_path)
    admit(sched, tel, request("a", PROMPT), range(10, 15))
    finish(sched, tel, request("a", PROMPT))
    plan = admit(sched, tel, request("b", PROMPT), range(20, 25))
    tel.report(loaded(plan))
    data = tel.stats()  # the cost is unknown yet: no series rather than 0 s saved
    assert not any(k.startswith("prefill_seconds") for k in [*data["counters"], *data["gauges"]])
    meter, t = sched.sched.insight.prefill_cost, 0.0
    for _ in range(8):
        meter.step(t, 1000, 1000, {"x"})
        meter.step(t + 2.0, 0, 1, {"x"})  # 2 ms a token
        t += 2.001
    data = tel.stats()  # the 512 tokens loaded earlier are priced once the cost is known
    assert abs(data["counters"]["prefill_seconds_saved|cpu"] - 1.024) < 1e-6
    assert abs(data["gauges"]["prefill_seconds_per_token"] - 0.002) < 1e-9


def test_unknown_lmcache_params_are_ignored_counted_and_logged_once(tmp_path, caplog):
    sched, tel = make(tmp_path)
    typo = {"lmcache.tags.user": "x", "lmcache.skip_save": True}  # a misspelt tag key
    with caplog.at_level("WARNING", logger="vllm.kvlens"):
        admit(sched, tel, request("a", PROMPT, kv_transfer_params=typo), range(10, 15))
        admit(sched, tel, request("b", [7] * 600, kv_transfer_params=typo), range(20, 25))
    assert sched.sched.trackers["a"].save_skip_reason.value == "skip_save"  # the known key still applies
    counters = tel.stats()["counters"]
    assert counters["ignored_request_params"] == 2
    assert sum("lmcache.tags.user" in r.getMessage() for r in caplog.records) <= 1


def test_the_disk_scrub_totals_become_counter_increments():
    from connector.engine.snapshots import SchedulerSizes
    from telemetry.encoding import retention_counts

    def sizes(records: int, damaged: int) -> SchedulerSizes:
        return SchedulerSizes(0, 0, 0, 0, 0, 0, disk_scrubbed_records=records, disk_scrub_damaged=damaged)

    assert retention_counts(sizes(0, 0)) == {}  # no scrub, no series
    assert retention_counts(sizes(12, 2)) == {"disk_scrubbed_records": 12, "disk_scrub_damaged": 2}


def test_prefill_seconds_saved_exists_at_zero_once_the_cost_is_known(tmp_path, monkeypatch):
    """A measured cost with nothing loaded (every repeat served by vLLM's own prefix cache) is
    "0 s saved", a series at 0, not an absent series that dashboards show as "no data"."""
    monkeypatch.setattr("telemetry.scheduler_recorder.GAUGE_INTERVAL_S", 0.0)
    sched, tel = make(tmp_path)
    data = tel.stats()
    assert not any(k.startswith("prefill_seconds_saved") for k in (data or {}).get("counters", {}))
    meter, t = sched.sched.insight.prefill_cost, 0.0
    for _ in range(8):
        meter.step(t, 1000, 1000, {"x"})
        meter.step(t + 2.0, 0, 1, {"x"})
        t += 2.001
    data = tel.stats()
    assert data["counters"]["prefill_seconds_saved|cpu"] == 0
    registry = CollectorRegistry()
    types = {kind: partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    PromRecorder(types, ["engine"], {0: ["0"]}, None, registry).observe(data)
    series = {"engine": "0", "tier": "cpu"}
    assert registry.get_sample_value("vllm:kvlens_prefill_seconds_saved_total", series) == 0
    assert "prefill_seconds_saved|cpu" not in (tel.stats() or {}).get("counters", {})  # once, not every step


def test_blended_requests_count_their_tokens_share_deviation_and_unreadable_chunks(tmp_path):
    from connector.engine.outcomes import BlendOutcome, ChunkProblem

    _, tel = make(tmp_path)
    blended = BlendOutcome("a", tokens=1000, reused_by_tier={CPU: 600}, recomputed=490, by_deviation=90)
    blended.not_reused, blended.deviation_mean = 400, 0.5
    blended.problems = [ChunkProblem(CPU, "x", FailureReason.CORRUPT)]
    tel.rec.blends_reported(
        {"a": blended, "b": BlendOutcome("b", tokens=50, failed="NotBlendable: no model")}
    )
    stats = tel.stats()
    counters, histograms = stats["counters"], stats["histograms"]
    assert counters["blend_requests|blended"] == 1 and counters["blend_requests|failed"] == 1
    assert counters["blend_tokens|reused"] == 600 and counters["blend_tokens|recomputed"] == 490
    assert (
        counters["blend_tokens|recomputed_by_deviation"] == 90 and counters["blend_tokens|not_stored"] == 400
    )
    assert counters["failed_chunks|load|cpu|corrupt"] == 1
    assert histograms["blend_recomputed_ratio"] == [0.49] and histograms["blend_deviation"] == [0.5]
