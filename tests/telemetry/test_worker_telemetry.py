"""Worker-side telemetry: one load span per request, one store span per request across steps."""

from __future__ import annotations

from opentelemetry.trace import StatusCode

from connector.engine.jobs import ChunkLoad, LoadJob, StepPlan, StoreJob
from connector.engine.outcomes import ChunkLoadResult, FailureReason, LoadOutcome, StoreFailure
from connector.engine.snapshots import WorkerSizes
from telemetry import tracing
from telemetry.settings import TelemetrySettings
from telemetry.worker_recorder import WorkerRecorder

BLOCK_NBYTES = 4096  # one block, every layer
HEADERS = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}


def make(rank=0, tracing_on=True, metrics=True, sizes=None):
    settings = TelemetrySettings.from_env(
        None, {"KVLENS_TRACING": str(int(tracing_on)), "KVLENS_METRICS": str(int(metrics))}
    )
    return WorkerRecorder(settings, rank, BLOCK_NBYTES, sizes)


def store(rid, name, blocks, tiers=("cpu",), ctx=HEADERS):
    return StoreJob(rid, name, tuple(blocks), tiers, 128 * len(blocks), trace_context=ctx)


def test_stores_over_several_steps_become_one_span_when_the_request_finishes(spans):
    tel = make()
    t = tel.now()
    tel.saved(StepPlan(writes=[store("a", "c0", [1, 2]), store("b", "d0", [5, 6])]), t, [])
    tel.saved(StepPlan(writes=[store("a", "c1", [3, 4], ("cpu", "disk"))]), tel.now(), [])
    assert not spans.get_finished_spans()  # still open: the request may store more
    tel.finished({"a"})
    (span,) = spans.get_finished_spans()
    attrs = span.attributes
    assert span.name == "kvlens.store" and attrs[tracing.A_REQUEST_ID] == "a"
    assert attrs[tracing.A_CHUNKS] == 2 and attrs[tracing.A_STORED_TOKENS] == 512
    assert attrs[tracing.A_BYTES] == 2 * BLOCK_NBYTES + 2 * 2 * BLOCK_NBYTES
    assert list(attrs[tracing.A_TIERS]) == ["cpu", "disk"] and attrs[tracing.A_STEPS] == 2
    assert format(span.context.trace_id, "032x") == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert span.start_time <= span.end_time
    tel.shutdown()  # b's record is flushed at shutdown
    assert [s.attributes[tracing.A_REQUEST_ID] for s in spans.get_finished_spans()] == ["a", "b"]


def test_failed_store_marks_the_span_and_is_not_counted_as_stored(spans):
    tel = make()
    tel.saved(
        StepPlan(writes=[store("a", "c0", [1, 2], ("cpu", "disk"))]),
        tel.now(),
        [StoreFailure("a", "c0", "disk", FailureReason.IO_ERROR, "OSError: disk full")],
    )
    assert tel.stats() is None  # stores are counted once a tier holds them (the workers' report)
    tel.finished(["a"])
    (span,) = spans.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR and span.attributes[tracing.A_FAILED_CHUNKS] == 1


def test_load_span_per_request_with_failure_details(spans):
    tel = make()
    ok = LoadJob("a", (ChunkLoad("c0", "cpu", (1, 2), 0, 256),), HEADERS)
    bad = LoadJob("b", (ChunkLoad("d0", "disk", (5, 6), 0, 256), ChunkLoad("d1", "disk", (7, 8), 0, 256)))
    outcomes = [
        LoadOutcome("a", [ChunkLoadResult("c0", "cpu", 256, "cpu")], [], 2 * BLOCK_NBYTES, 0.001),
        LoadOutcome(
            "b",
            [
                ChunkLoadResult("d0", "disk", 256, None, FailureReason.CORRUPT, "bad checksum"),
                ChunkLoadResult("d1", "disk", 256, None, FailureReason.PREFIX_FAILED),
            ],
            [5, 6, 7, 8],
            0,
            0.002,
        ),
    ]
    start = tel.now()
    tel.loaded(StepPlan(loads=[ok, bad]), outcomes, start)
    first, second = spans.get_finished_spans()
    assert first.attributes[tracing.A_LOADED_TOKENS] == 256 and first.status.status_code is StatusCode.UNSET
    assert first.parent is not None and second.parent is None
    assert second.start_time == first.end_time == start + 1_000_000
    assert second.status.status_code is StatusCode.ERROR
    assert (
        second.attributes[tracing.A_FAILED_BLOCKS] == 4
        and second.attributes[tracing.A_ERROR_TYPE] == "corrupt"
        and second.attributes[tracing.A_FAILED_CHUNKS] == 2
    )
    (event,) = second.events
    assert list(event.attributes[tracing.A_BLOCK_IDS]) == [5, 6, 7, 8]


def test_off_means_no_records_and_no_stats(spans):
    tel = make(tracing_on=False, metrics=False)
    assert tel.now() == 0
    tel.saved(StepPlan(writes=[store("a", "c0", [1, 2])]), 0, [])
    assert not tel.stores and tel.stats() is None and not spans.get_finished_spans()


def test_worker_gauges_are_shipped_when_they_change():
    sizes = [WorkerSizes(0, 0)]
    tel = make(rank=1, tracing_on=False, sizes=lambda: sizes[0])
    assert tel.stats()["gauges"] == {  # per rank: summed on /metrics
        "invalid_block_ids#1": 0,
        "reusable_buffer_bytes#1": 0,
    }
    assert tel.stats() is None
    sizes[0] = WorkerSizes(4, 0)
    assert tel.stats()["gauges"] == {"invalid_block_ids#1": 4}


def test_store_latency_is_observed_once_per_request_when_it_finishes():
    tel = make(tracing_on=False)
    tel.saved(StepPlan(writes=[store("a", "c0", [1, 2])]), tel.now(), [])
    tel.saved(StepPlan(writes=[store("a", "c1", [3, 4])]), tel.now(), [])
    assert "operation_seconds|store" not in (tel.stats() or {}).get("histograms", {})
    tel.finished({"a"})
    assert len(tel.stats()["histograms"]["operation_seconds|store"]) == 1


def test_a_worker_gauge_that_changed_in_the_last_step_before_idle_is_shipped_with_it():
    """vLLM asks for the worker's stats once per step; an engine that goes idle right after a
    step that evicted or stored never asks again. Sampled at most every 0.1 s, the CPU tier's
    bytes stayed at their value of an earlier step (a TP run read 2 MiB stored, 1.5 MiB indexed)."""
    sizes = [WorkerSizes(0, 0, 1024)]
    tel = make(rank=1, tracing_on=False, sizes=lambda: sizes[0])
    assert tel.stats()["gauges"]["tier_stored_bytes|cpu#1"] == 1024
    sizes[0] = WorkerSizes(0, 0, 768)  # the next step, a millisecond later: its last
    assert tel.stats()["gauges"] == {"tier_stored_bytes|cpu#1": 768}
