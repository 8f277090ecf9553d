"""Span emission: client trace context, explicit times, attributes only when sampled."""

from __future__ import annotations

from opentelemetry.trace import StatusCode

from telemetry import tracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


def test_span_joins_the_clients_trace_with_explicit_times(spans):
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT}-01"}
    tracing.emit(tracing.LOAD, headers, 1_000, 5_000, lambda: {tracing.A_LOADED_TOKENS: 512})
    (span,) = spans.get_finished_spans()
    assert span.name == "kvlens.load"
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert format(span.parent.span_id, "016x") == PARENT
    assert (span.start_time, span.end_time) == (1_000, 5_000)
    assert span.attributes[tracing.A_LOADED_TOKENS] == 512


def test_span_without_context_is_a_root(spans):
    tracing.emit(tracing.LOOKUP, None, 10, 20, dict)
    (span,) = spans.get_finished_spans()
    assert span.parent is None


def test_attributes_are_not_computed_for_unsampled_traces(spans):
    called = []
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT}-00"}  # the client did not sample
    tracing.emit(tracing.STORE, headers, 10, 20, lambda: called.append(1) or {})
    assert not spans.get_finished_spans() and not called


def test_failure_sets_error_status_and_records_the_event(spans):
    tracing.emit(
        tracing.LOAD,
        None,
        10,
        20,
        dict,
        error="corrupt",
        events=[("kvlens.load_failed", {tracing.A_BLOCK_IDS: [4, 5]})],
    )
    (span,) = spans.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes[tracing.A_ERROR_TYPE] == "corrupt"
    assert span.events[0].name == "kvlens.load_failed"
    assert list(span.events[0].attributes[tracing.A_BLOCK_IDS]) == [4, 5]


def test_drain_returns_once_a_span_another_thread_is_building_is_finished_too(spans):
    """The builder thread may be building a span when a flush (exit, a reader) drains the queue:
    the flush returns with that span finished, and spans are finished in the order queued."""
    import threading

    building, release = threading.Event(), threading.Event()

    def slow_attributes() -> dict:
        building.set()
        release.wait(5)
        return {}

    tracing.emit(tracing.LOAD, None, 10, 20, slow_attributes)
    builder = threading.Thread(target=tracing.drain)  # as the builder thread does
    builder.start()
    assert building.wait(5)
    tracing.emit(tracing.STORE, None, 30, 40, dict)
    threading.Timer(0.3, release.set).start()  # the flush below must wait this out
    finished = spans.get_finished_spans()
    builder.join(5)
    assert [s.name for s in finished] == ["kvlens.load", "kvlens.store"]
