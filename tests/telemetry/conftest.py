"""Fixtures for the telemetry tests: an in-memory span exporter for the unit tests and the
tiny model for the tests that run a real ``vllm serve``."""

from __future__ import annotations

import contextlib

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from telemetry import tracing

_EXPORTER = InMemorySpanExporter()


class _Spans:
    """The in-memory exporter, reading only after KVLens built the spans it queued."""

    def get_finished_spans(self):
        tracing.drain()
        return _EXPORTER.get_finished_spans()


@pytest.fixture
def spans():
    """Finished spans of the global provider (installed once per test process)."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
        trace.set_tracer_provider(provider)
    tracing.drain()
    tracing.reset_for_tests()
    _EXPORTER.clear()
    yield _Spans()
    tracing.drain()
    _EXPORTER.clear()


@pytest.fixture(scope="module")
def serve_stack(request, tiny_model, tmp_path_factory):
    """One ``vllm serve`` with KVLens plus a real OTLP/HTTP receiver, shared by a test module.

    The module sets ``KV_CONFIG`` (the --kv-transfer-config dict, ``{tmp}`` is replaced by a
    temporary directory) and may set ``SERVE_ARGS``, ``SERVE_ENV`` (environment, ``{tmp}`` too),
    ``EVENT_STREAM = True`` (vLLM's KV events to ``events``, an EventStream bound first) and
    ``WORKER_PROCESS = False`` (the worker in the engine core: ``VllmServer``).
    """
    m = request.module
    with running_stack(
        tiny_model,
        tmp_path_factory.mktemp("serve"),
        m.KV_CONFIG,
        getattr(m, "SERVE_ENV", {}),
        getattr(m, "SERVE_ARGS", ()),
        getattr(m, "EVENT_STREAM", False),
        getattr(m, "WORKER_PROCESS", True),
    ) as stack:
        yield stack


@contextlib.contextmanager
def running_stack(tiny_model, tmp, kv_config, serve_env, serve_args, event_stream, worker_process=True):
    """The server of ``serve_stack`` (and of the package fixture in ``cpu_tier/``)."""
    import json
    from types import SimpleNamespace

    from .otlp_receiver import OtlpReceiver
    from .serve import EventStream, VllmServer, base_env

    kv_config = json.loads(json.dumps(kv_config).replace("{tmp}", str(tmp)))
    events = EventStream() if event_stream else None  # bound before vLLM is told its port
    with OtlpReceiver() as receiver:
        env = base_env(
            OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf",
            OTEL_BSP_SCHEDULE_DELAY="200",
            KVLENS_EVENT_LOG=str(tmp / "events.jsonl"),
            **{k: v.replace("{tmp}", str(tmp)) for k, v in serve_env.items()},
        )
        args = ("--otlp-traces-endpoint", receiver.endpoint, *serve_args)
        if events is not None:
            args += events.vllm_args()
        server = VllmServer(
            tiny_model, kv_config, tmp / "serve.log", env, args, worker_process=worker_process
        )
        try:
            server.wait_ready()
            yield SimpleNamespace(
                server=server, receiver=receiver, tmp=tmp, kv_config=kv_config, events=events
            )
        finally:
            server.stop()
            if events is not None:
                events.close()
