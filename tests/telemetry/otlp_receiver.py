"""A real OTLP/HTTP trace receiver for tests: decodes ExportTraceServiceRequest protobufs.

with OtlpReceiver() as receiver:
    ... point OTEL_EXPORTER_OTLP_TRACES_ENDPOINT at receiver.endpoint ...
    spans = receiver.wait_for(lambda spans: ..., timeout=30)
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str
    events: list[tuple[str, dict[str, Any]]]
    resource: dict[str, Any] = field(default_factory=dict)
    scope: str = ""


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def decode(body: bytes) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for rs in request.resource_spans:
        resource = _attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append(
                    ReceivedSpan(
                        name=s.name,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(),
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes=_attrs(s.attributes),
                        status_code=s.status.code,
                        status_message=s.status.message,
                        events=[(e.name, _attrs(e.attributes)) for e in s.events],
                        resource=resource,
                        scope=ss.scope.name,
                    )
                )
    return spans


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self._cond = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                encoding = (self.headers.get("Content-Encoding") or "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path.rstrip("/") != "/v1/traces":
                    self.send_error(404)
                    return
                spans = decode(body)
                with receiver._cond:
                    receiver.spans.extend(spans)
                    receiver.requests += 1
                    receiver._cond.notify_all()
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def snapshot(self) -> list[ReceivedSpan]:
        with self._cond:
            return list(self.spans)

    def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], Any], timeout: float = 30.0
    ) -> list[ReceivedSpan]:
        """Waits until ``predicate(spans)`` is truthy; returns the spans (raises on timeout)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(list(self.spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({(s.name, s.trace_id[:8]) for s in self.spans})
                    raise TimeoutError(f"spans never matched within {timeout}s; received {names}")
                self._cond.wait(min(left, 0.5))
            return list(self.spans)
