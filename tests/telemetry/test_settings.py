"""When tracing and metrics are on."""

from __future__ import annotations

import tempfile

import pytest

from telemetry.settings import TelemetrySettings


def settings(endpoint=None, **env):
    return TelemetrySettings.from_env(endpoint, env)


def test_off_without_any_endpoint():
    s = settings()
    assert not s.tracing and s.metrics and s.metrics_port is None


def test_vllm_otlp_endpoint_alone_turns_tracing_on():
    assert settings("http://127.0.0.1:4317").tracing


@pytest.mark.parametrize("var", ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"])
def test_standard_otel_endpoints_turn_tracing_on(var):
    assert settings(**{var: "http://collector:4318"}).tracing


def test_sdk_disabled_or_no_exporter_turns_tracing_off():
    assert not settings("http://x:4317", OTEL_SDK_DISABLED="true").tracing
    assert not settings("http://x:4317", OTEL_TRACES_EXPORTER="none").tracing


def test_kvlens_overrides_win():
    assert not settings("http://x:4317", KVLENS_TRACING="0").tracing
    assert settings(KVLENS_TRACING="1").tracing
    assert not settings(KVLENS_METRICS="off").metrics


def test_event_log_defaults_to_a_per_user_directory():
    assert settings(HOME="/nonexistent").event_log.startswith(tempfile.gettempdir() + "/kvlens-")
    assert settings(KVLENS_EVENT_LOG="/var/log/kv.jsonl").event_log == "/var/log/kv.jsonl"


def test_metrics_port_is_validated():
    assert settings(KVLENS_METRICS_PORT="9464").metrics_port == 9464
    with pytest.raises(ValueError):
        settings(KVLENS_METRICS_PORT="70000")
