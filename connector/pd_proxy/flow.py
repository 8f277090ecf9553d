"""One request through ``kvlens pd-proxy``: its record, its spans and the trace context its
backend calls carry, and the one place where it ends (outcome counted, record kept, span closed)."""

from __future__ import annotations

import os
import secrets
import time
import uuid
from typing import Any

from .backends import Backend
from .observe import RequestRecord, new_traceparent, parse_traceparent


class Flow:
    """One request's record, spans and trace context, finished exactly once. ``proxy`` is the
    ``PDProxy`` (its tracer, metrics, notice board and records)."""

    def __init__(self, proxy: Any, kind: str, stream: bool, pair: tuple[Backend | None, Backend], headers):
        self.proxy = proxy
        self.prefiller, self.decoder = pair
        self.t0 = time.monotonic()
        self.req_id = f"kvlens-pd-{uuid.uuid4().hex}"
        self.timed_out = False
        self.span = None
        self._client_trace = {k: headers[k] for k in ("traceparent", "tracestate") if k in headers}
        self._auth = headers.get("authorization") or (
            f"Bearer {os.environ['OPENAI_API_KEY']}" if os.environ.get("OPENAI_API_KEY") else None
        )
        if proxy.tracer.recording:
            attrs = {"kvlens.pd.req_id": self.req_id, "kvlens.pd.decoder": self.decoder.name}
            self.span = proxy.tracer.request_span(self._client_trace, attrs)
            trace_id, self._flags = proxy.tracer.trace_id_of(self.span), "01"
        else:
            parsed = parse_traceparent(self._client_trace.get("traceparent"))
            trace_id, self._flags = parsed if parsed else (secrets.token_hex(16), "01")
        self.record = RequestRecord(
            self.req_id,
            kind,
            stream,
            self.prefiller.name if self.prefiller else None,
            self.decoder.name,
            trace_id,
            started_at=time.time(),
        )
        self._done = False
        proxy.metrics.in_flight.inc()

    def phase(self, name: str) -> Any:
        return self.proxy.tracer.child(self.span, name) if self.span is not None else None

    def headers(self, phase_span: Any = None) -> dict[str, str]:
        """What a backend call carries: the trace context (one trace for the whole request)."""
        out = {"authorization": self._auth} if self._auth else {}
        if phase_span is not None:
            out.update(self.proxy.tracer.headers_of(phase_span))
        else:
            out["traceparent"] = new_traceparent(self.record.trace_id, self._flags)
        if "tracestate" in self._client_trace and "tracestate" not in out:
            out["tracestate"] = self._client_trace["tracestate"]
        return out

    def observe(self, phase: str, seconds: float, span: Any = None) -> None:
        setattr(self.record, f"{phase}_ms", round(seconds * 1e3, 3))
        prefiller = self.prefiller.name if self.prefiller else ""
        self.proxy.metrics.phase.labels(phase, prefiller, self.decoder.name).observe(seconds)
        if span is not None:
            span.end()

    def finish(self, outcome: str, error: str | None = None) -> None:
        if self._done:
            return
        self._done = True
        proxy = self.proxy
        self.record.outcome, self.record.error = outcome, error
        self.record.total_ms = round((time.monotonic() - self.t0) * 1e3, 3)
        proxy.metrics.requests.labels(outcome).inc()
        proxy.metrics.in_flight.dec()
        proxy.board.forget(self.req_id)
        proxy.records.add(self.record)
        if self.span is not None:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_attribute("kvlens.pd.outcome", outcome)
            if self.record.prompt_tokens is not None:
                self.span.set_attribute("kvlens.pd.prompt_tokens", self.record.prompt_tokens)
            if error:
                self.span.set_status(Status(StatusCode.ERROR, error[:500]))
            self.span.end()
