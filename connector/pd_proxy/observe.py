"""What ``kvlens pd-proxy`` tells about its requests: its own Prometheus series
(``kvlens_pd_proxy_*``), a record per request (``GET /kvlens/pd/requests``, ``--request-log``),
and the trace context it passes on to the prefiller and the decoder.

Phases of a disaggregated request, as the records and ``kvlens_pd_proxy_phase_seconds`` name them:
``prefill`` (the prefiller's answer: the whole prompt computed, first token sampled),
``transfer_wait`` (its answer -> every decoder rank's notification, or the bound),
``decode_first_token`` (the decoder asked -> its first token) and ``ttft`` (the request's arrival
-> the decoder's first token; the client saw the prefiller's token at the end of ``prefill``).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import secrets
import threading
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

logger = logging.getLogger(__name__)

PHASES = ("prefill", "transfer_wait", "decode_first_token", "ttft")
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Per request, once: "ok" (the decoder answered after every notification), "notify_timeout" (it
# answered, asked after the bound: it recomputed what did not arrive), "prefill_only" (the
# prefiller's one token was the whole answer), "routed" (--no-pd), "bad_request", "tokenize_failed",
# "prefill_failed", "decode_failed", "client_gone".
OUTCOMES = (
    "ok",
    "notify_timeout",
    "prefill_only",
    "routed",
    "bad_request",
    "tokenize_failed",
    "prefill_failed",
    "decode_failed",
    "client_gone",
)


class ProxyMetrics:
    """The proxy's series in a registry of its own (served on its ``/metrics``)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvlens_pd_proxy_requests", "Requests by how they ended", ["outcome"], registry=r
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.phase = Histogram(
            "kvlens_pd_proxy_phase_seconds",
            "Where a disaggregated request's time went",
            ["phase", "prefiller", "decoder"],
            buckets=BUCKETS,
            registry=r,
        )
        self.wait_timeouts = Counter(
            "kvlens_pd_proxy_wait_timeouts",
            "Requests whose notifications did not all arrive within --notify-timeout",
            ["prefiller", "decoder"],
            registry=r,
        )
        self.in_flight = Gauge("kvlens_pd_proxy_in_flight", "Requests being served", registry=r)
        self.stray = Counter(
            "kvlens_pd_proxy_stray_notifications",
            "Notifications for no waiting request (late, after the bound, or not this proxy's)",
            registry=r,
        )
        self.malformed = Counter(
            "kvlens_pd_proxy_malformed_notifications", "Messages that were not a ProxyNotif", registry=r
        )


@dataclass(slots=True)
class RequestRecord:
    """One request as ``GET /kvlens/pd/requests`` shows it (times in ms, None where not reached)."""

    req_id: str
    endpoint: str
    stream: bool
    prefiller: str | None
    decoder: str
    trace_id: str
    prompt_tokens: int | None = None
    max_tokens: int | None = None
    outcome: str = "client_gone"
    ttft_ms: float | None = None
    prefill_ms: float | None = None
    transfer_wait_ms: float | None = None
    decode_first_token_ms: float | None = None
    total_ms: float | None = None
    notifications: str | None = None  # "arrived/expected"
    decoder_pd: dict[str, Any] | None = None  # the decoder's kv_transfer_params.kvlens.pd
    error: str | None = None
    started_at: float = 0.0  # unix time
    _phases: dict[str, float] = field(default_factory=dict, repr=False)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("_phases")
        return out


class RecordLog:
    """The newest ``keep`` records in memory, and every record as a JSON line in ``path``."""

    def __init__(self, keep: int, path: str | None) -> None:
        self._records: collections.deque[dict[str, Any]] = collections.deque(maxlen=max(keep, 0) or None)
        self._keep = keep
        self._lock = threading.Lock()
        self._file = open(path, "a", buffering=1) if path else None  # noqa: SIM115 - closed in close()

    def add(self, record: RequestRecord) -> None:
        data = record.to_json()
        with self._lock:
            if self._keep:
                self._records.append(data)
            if self._file is not None:
                try:
                    self._file.write(json.dumps(data, separators=(",", ":")) + "\n")
                except OSError as e:  # a full disk loses log lines, never a request
                    logger.warning("kvlens pd-proxy: --request-log: %s", e)

    def newest(self, limit: int) -> list[dict[str, Any]]:
        with self._lock:
            items = list(self._records)
        return items[::-1][: max(limit, 0)]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# ---- trace context ------------------------------------------------------------------------------


def tracing_configured(env: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """True when the standard OTEL_* variables ask for traces to be exported."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return bool(exporter or endpoint)


def provider_from_env() -> Any:
    """An SDK tracer provider exporting as the OTEL_* variables say (OTLP over gRPC unless
    OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL is http/protobuf or gRPC is not installed; ``console``)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    provider = TracerProvider(resource=Resource.create({} if named else {"service.name": "kvlens-pd-proxy"}))
    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        return provider
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    ).strip()
    exporter = None
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

            exporter = Grpc(insecure=True)
        except ImportError:
            logger.warning("kvlens pd-proxy: OTLP gRPC exporter not installed; exporting over http/protobuf")
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

        exporter = Http()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def parse_traceparent(value: str | None) -> tuple[str, str] | None:
    """(trace id, flags) of a valid W3C ``traceparent``, else None."""
    if not value:
        return None
    parts = value.strip().split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or len(parts[2]) != 16 or len(parts[3]) != 2:
        return None
    try:
        int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return None
    if int(parts[1], 16) == 0 or int(parts[2], 16) == 0:
        return None
    return parts[1].lower(), parts[3].lower()


def new_traceparent(trace_id: str | None = None, flags: str = "01") -> str:
    """A traceparent of a new span (in ``trace_id``'s trace, or a new trace)."""
    return f"00-{trace_id or secrets.token_hex(16)}-{secrets.token_hex(8)}-{flags}"


class Tracer:
    """Spans ``kvlens.pd.proxy`` (one per request) with a child per phase when a provider is
    given; without one, only the trace context: the client's trace continues (a new span id per
    backend call), or a new trace starts, so the prefiller's and decoder's spans share one trace."""

    def __init__(self, provider: Any = None) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer("kvlens.pd_proxy") if provider is not None else None
        if self._tracer is not None:
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            self._propagator = TraceContextTextMapPropagator()

    @property
    def recording(self) -> bool:
        return self._tracer is not None

    def request_span(self, headers: dict[str, str], attributes: dict[str, Any]) -> Any:
        from opentelemetry.trace import SpanKind

        parent = self._propagator.extract(headers) if headers.get("traceparent") else None
        return self._tracer.start_span("kvlens.pd.proxy", parent, SpanKind.SERVER, attributes)

    def child(self, parent: Any, phase: str, attributes: dict[str, Any] | None = None) -> Any:
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        ctx = trace.set_span_in_context(parent)
        return self._tracer.start_span(f"kvlens.pd.{phase}", ctx, SpanKind.CLIENT, attributes or {})

    def headers_of(self, span: Any) -> dict[str, str]:
        from opentelemetry import trace

        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, trace.set_span_in_context(span))
        return carrier

    @staticmethod
    def trace_id_of(span: Any) -> str:
        return format(span.get_span_context().trace_id, "032x")

    def shutdown(self) -> None:
        if self.provider is not None and hasattr(self.provider, "shutdown"):
            self.provider.shutdown()
