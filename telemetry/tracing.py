"""KVLens spans: one per request and operation, emitted once the operation's outcome is known.

Spans are created after the fact with explicit start and end times (a step serves many
requests; per-request spans are cut out of it later), parented to the client's W3C trace
context when the request carried one. Attributes are computed only for recording spans.

The engine's step loop only queues a span's ingredients (``emit``, about a microsecond); a
daemon thread builds the spans (tens of microseconds each in the SDK) while the step loop
waits on the model, and hands them to the provider's batch processor. ``flush`` builds what
is queued and exports it (shutdown); ``drain`` just builds (tests).

The provider: vLLM installs one in every process when it traces (``--otlp-traces-endpoint``
or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``); KVLens uses it. Otherwise, on the first span,
KVLens installs an SDK provider with a BatchSpanProcessor and an OTLP exporter configured by
the standard ``OTEL_*`` variables (service name, sampler, endpoint, protocol, batching).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger("vllm.kvlens")

TRACER_NAME = "kvlens"

# Span names.
LOOKUP, LOAD, STORE = "kvlens.lookup", "kvlens.load", "kvlens.store"
BLEND = "kvlens.blend"  # a blended request's reuse and recompute, before its forward pass

# Attribute names (stable; dashboards and tests rely on them).
A_REQUEST_ID = "kvlens.request_id"
A_PROMPT_TOKENS = "kvlens.prompt_tokens"
A_VLLM_CACHED_TOKENS = "kvlens.vllm_cached_tokens"
A_HIT_TOKENS = "kvlens.hit_tokens"
A_HIT_RATE = "kvlens.hit_rate"
A_EXTERNAL_TOKENS = "kvlens.external_tokens"  # tokens the lookup told vLLM KVLens will load
A_LOADED_TOKENS = "kvlens.loaded_tokens"
A_PLANNED_TOKENS = "kvlens.planned_tokens"
A_STORED_TOKENS = "kvlens.stored_tokens"
A_BYTES = "kvlens.bytes"
A_CHUNKS = "kvlens.chunks"
A_BLOCKS = "kvlens.blocks"
A_TIERS = "kvlens.tiers"
A_MISS_REASON = "kvlens.miss_reason"
A_SAVE_SKIP_REASON = "kvlens.save_skip_reason"
A_FAILED_BLOCKS = "kvlens.failed_blocks"
A_FAILED_CHUNKS = "kvlens.failed_chunks"
A_ATTEMPTS = "kvlens.lookup_attempts"
A_SCHEDULED = "kvlens.scheduled"
A_RESUMED = "kvlens.resumed"  # a preempted request looked up again
A_STEPS = "kvlens.steps"  # engine steps a request's stores spread over
A_STORE_SECONDS = "kvlens.store_seconds"
A_RANK = "kvlens.rank"
A_RECOMPUTE = "kvlens.recompute"
A_BLOCK_IDS = "kvlens.block_ids"
A_REASON = "kvlens.reason"
A_MODEL = "gen_ai.request.model"
A_CACHE_READ = "gen_ai.usage.cache_read.input_tokens"
A_ERROR_TYPE = "error.type"
A_REUSED_TOKENS = "kvlens.blend.reused_tokens"
A_RECOMPUTED_TOKENS = "kvlens.blend.recomputed_tokens"
A_BY_DEVIATION = "kvlens.blend.recomputed_by_deviation"
A_DEVIATION_MEAN = "kvlens.blend.deviation_mean"
A_DEVIATION_MAX = "kvlens.blend.deviation_max"

REMOTE_CALL = "kvlens.remote"  # CLIENT child span of a lookup, load or store: one Redis round trip


@dataclass(frozen=True, slots=True)
class Child:
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    error: str | None = None


MAX_PENDING = 16384  # spans queued for building; beyond this new spans are dropped (and counted)
BUILD_INTERVAL_S = 0.05

_propagator = TraceContextTextMapPropagator()
_setup_lock = threading.Lock()
_tracer: Any = None
_pending: deque[tuple[Any, ...]] = deque()
_draining = threading.Lock()  # one span taken and built at a time (drain)
_wake = threading.Event()
_stopping = threading.Event()
_builder: threading.Thread | None = None
_builder_pid: int | None = None
dropped = 0


def parent_context(headers: Mapping[str, str] | None) -> Any:
    """The OpenTelemetry context of a request's ``traceparent`` / ``tracestate`` headers."""
    traceparent = headers.get("traceparent") if headers else None
    return _context_of(traceparent, headers.get("tracestate")) if traceparent else None


@functools.lru_cache(maxsize=4096)
def _context_of(traceparent: str, tracestate: str | None) -> Any:
    """Parsing costs ~20 us; a request's spans share it (contexts are immutable)."""
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    return _propagator.extract(carrier)


def get_tracer(otlp_endpoint: str | None = None) -> Any:
    global _tracer
    if _tracer is None:
        with _setup_lock:
            if _tracer is None:
                _tracer = _ensure_provider(otlp_endpoint).get_tracer(TRACER_NAME)
    return _tracer


def _ensure_provider(otlp_endpoint: str | None) -> Any:
    provider = trace.get_tracer_provider()
    if not isinstance(provider, trace.ProxyTracerProvider):
        return provider  # vLLM's (or the application's)
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource_env = os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in resource_env
    attributes = {} if named else {"service.name": "kvlens"}
    own = TracerProvider(resource=Resource.create(attributes))  # sampler from OTEL_TRACES_SAMPLER
    own.add_span_processor(BatchSpanProcessor(_exporter(otlp_endpoint)))
    trace.set_tracer_provider(own)
    atexit.register(own.shutdown)
    logger.info("KVLens: tracing with its own OpenTelemetry provider (pid %d)", os.getpid())
    return trace.get_tracer_provider()


def _exporter(otlp_endpoint: str | None) -> Any:
    """OTLP exporter like vLLM's: gRPC unless OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL says otherwise."""
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    ).strip()
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
        except ImportError:
            logger.warning("KVLens: OTLP gRPC exporter not installed; exporting over http/protobuf")
        else:
            return Grpc(endpoint=otlp_endpoint, insecure=True) if otlp_endpoint else Grpc()
    elif protocol != "http/protobuf":
        logger.warning("KVLens: OTLP protocol %r not supported; exporting over http/protobuf", protocol)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

    return Http(endpoint=otlp_endpoint) if otlp_endpoint else Http()


def emit(
    name: str,
    headers: Mapping[str, str] | None,
    start_ns: int,
    end_ns: int,
    attributes: Callable[[], dict[str, Any]],
    error: str | None = None,
    events: Sequence[tuple[str, dict[str, Any]]] = (),
    otlp_endpoint: str | None = None,
    children: Sequence[Child] = (),
) -> None:
    """Queue one finished span; ``attributes`` is called later, and only if it is sampled.

    ``children`` become CLIENT spans under it (remote round trips). Whatever ``attributes``,
    ``events`` and ``children`` refer to must not change after this call.
    """
    global dropped
    if len(_pending) >= MAX_PENDING:
        dropped += 1
        if dropped == 1:
            logger.warning("KVLens: span queue full (%d); dropping spans", MAX_PENDING)
        return
    _pending.append((name, headers, start_ns, end_ns, attributes, error, events, otlp_endpoint, children))
    if _builder_pid != os.getpid():
        _start_builder()


def _start_builder() -> None:
    global _builder_pid
    with _setup_lock:
        if _builder_pid == os.getpid():
            return
        _builder_pid = os.getpid()
        global _builder
        _builder = threading.Thread(target=_build_forever, name="kvlens-spans", daemon=True)
        _builder.start()
        atexit.register(stop_builder)  # runs before the provider's own atexit shutdown (registered earlier)


def _build_forever() -> None:
    while not _stopping.is_set():
        _wake.wait(BUILD_INTERVAL_S)
        _wake.clear()
        drain(yield_gil=True)


def stop_builder(timeout_s: float = 2.0) -> None:
    """Stop and join the builder thread, then build what is left (process exit)."""
    _stopping.set()
    _wake.set()
    if _builder is not None and _builder.is_alive() and _builder is not threading.current_thread():
        _builder.join(timeout_s)
    drain()


def drain(yield_gil: bool = False) -> None:
    """Build every queued span now, and return once they are all finished, also one that another
    thread (the builder) was building when this was called: spans are taken and built one at a
    time under a lock, so they finish in the order they were queued.

    The builder thread yields the GIL after each span: without that, an engine thread that
    wants the GIL back waits out Python's whole switch interval (5 ms) behind it.
    """
    while True:
        with _draining:
            try:
                item = _pending.popleft()
            except IndexError:
                return
            try:
                _build(*item)
            except Exception as e:  # a broken exporter or attribute must not stop the others
                logger.warning("KVLens: could not record span %s: %s", item[0], e)
        if yield_gil:
            time.sleep(0)


def _build(
    name: str,
    headers: Mapping[str, str] | None,
    start_ns: int,
    end_ns: int,
    attributes: Callable[[], dict[str, Any]],
    error: str | None,
    events: Sequence[tuple[str, dict[str, Any]]],
    otlp_endpoint: str | None,
    children: Sequence[Child] = (),
) -> None:
    tracer = _tracer if _tracer is not None else get_tracer(otlp_endpoint)
    span = tracer.start_span(
        name, context=parent_context(headers), kind=SpanKind.INTERNAL, start_time=start_ns
    )
    if span.is_recording():
        span.set_attributes(attributes())
        for event_name, event_attributes in events:
            span.add_event(event_name, event_attributes, timestamp=end_ns)
        if error is not None:
            span.set_attribute(A_ERROR_TYPE, error)
            span.set_status(Status(StatusCode.ERROR, error))
        within = trace.set_span_in_context(span)
        for child in children:
            sub = tracer.start_span(
                child.name, context=within, kind=SpanKind.CLIENT, start_time=child.start_ns
            )
            sub.set_attributes(child.attributes)
            if child.error is not None:
                sub.set_attribute(A_ERROR_TYPE, child.error)
                sub.set_status(Status(StatusCode.ERROR, child.error))
            sub.end(end_time=max(child.end_ns, child.start_ns))
    span.end(end_time=max(end_ns, start_ns))


def flush(timeout_ms: int = 5000) -> None:
    """Build what is queued and export what is buffered (engine shutdown)."""
    drain()
    provider = trace.get_tracer_provider()
    force_flush = getattr(provider, "force_flush", None)
    if force_flush is not None:
        try:
            force_flush(timeout_ms)
        except Exception as e:  # never let telemetry break a shutdown
            logger.warning("KVLens: flushing spans failed: %s", e)


def reset_for_tests() -> None:
    global _tracer
    _tracer = None
