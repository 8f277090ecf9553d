"""What telemetry is on, decided once per process from vLLM's config and the environment.

This is the only telemetry module that reads environment variables. The OpenTelemetry SDK
itself still reads the standard ``OTEL_*`` variables (service name, sampler, batch processor,
exporter endpoint and protocol) when KVLens sets up its own provider.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")

DEFAULT_EVENT_LOG_NAME = "kvlens-events.jsonl"
DEFAULT_REQUEST_LOG_NAME = "kvlens-requests.jsonl"


@dataclass(frozen=True, slots=True)
class TelemetrySettings:
    tracing: bool  # emit kvlens.lookup / load / store spans
    metrics: bool  # fill the connector-stats payload vLLM turns into vllm:kvlens_* metrics
    metrics_port: int | None  # extra exporter on 127.0.0.1 (offline engines)
    otlp_endpoint: str | None  # vLLM's --otlp-traces-endpoint, when set
    event_log: str  # JSON-lines file of failed loads
    event_log_max_bytes: int
    event_log_backups: int
    request_log: str | None = None  # JSON-lines file, one line per finished request; None = off
    request_log_sample: float = 1.0  # share of request ids logged, 0..1 (the size limits are shared)

    @classmethod
    def from_env(
        cls, otlp_endpoint: str | None = None, env: Mapping[str, str] | None = None
    ) -> TelemetrySettings:
        env = os.environ if env is None else env
        return cls(
            tracing=_tracing_wanted(otlp_endpoint, env),
            metrics=_flag(env.get("KVLENS_METRICS"), default=True),
            metrics_port=_port(env.get("KVLENS_METRICS_PORT")),
            otlp_endpoint=otlp_endpoint or None,
            event_log=env.get("KVLENS_EVENT_LOG") or default_event_log(env),
            event_log_max_bytes=_positive_int(env.get("KVLENS_EVENT_LOG_MAX_BYTES"), 10 * 1024 * 1024),
            event_log_backups=_positive_int(env.get("KVLENS_EVENT_LOG_BACKUPS"), 3),
            request_log=request_log_path(env),
            request_log_sample=_sample_rate(env.get("KVLENS_REQUEST_LOG_SAMPLE")),
        )


def default_event_log(env: Mapping[str, str] | None = None) -> str:
    """A per-user location: ``$XDG_STATE_HOME/kvlens`` or ``~/.local/state/kvlens``; without a
    home directory, a ``kvlens-<uid>`` directory in the temp directory (created 0700)."""
    env = os.environ if env is None else env
    state = env.get("XDG_STATE_HOME")
    home = env.get("HOME") or os.path.expanduser("~")
    if state:
        base = os.path.join(state, "kvlens")
    elif home and home != "~" and os.path.isdir(home):
        base = os.path.join(home, ".local", "state", "kvlens")
    else:
        base = os.path.join(tempfile.gettempdir(), f"kvlens-{os.getuid()}")
    return os.path.join(base, DEFAULT_EVENT_LOG_NAME)


def request_log_path(env: Mapping[str, str] | None = None) -> str | None:
    """``KVLENS_REQUEST_LOG``: a path; unset, empty or 0/off = no request log; 1/on = a
    ``kvlens-requests.jsonl`` beside the default event log."""
    env = os.environ if env is None else env
    raw = (env.get("KVLENS_REQUEST_LOG") or "").strip()
    if not raw or raw.lower() in _OFF:
        return None
    if raw.lower() in _ON:
        return os.path.join(os.path.dirname(default_event_log(env)), DEFAULT_REQUEST_LOG_NAME)
    return raw


def _sample_rate(raw: str | None) -> float:
    if raw is None or not raw.strip():
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:  # also refuses nan
        raise ValueError(f"KVLENS_REQUEST_LOG_SAMPLE must be a number from 0 to 1, got {raw!r}")
    return value


def _tracing_wanted(otlp_endpoint: str | None, env: Mapping[str, str]) -> bool:
    """On when vLLM traces or an OTLP endpoint is configured; KVLENS_TRACING overrides."""
    override = env.get("KVLENS_TRACING")
    if override is not None and override.strip().lower() in _OFF + _ON:
        return override.strip().lower() in _ON
    if _flag(env.get("OTEL_SDK_DISABLED"), default=False):
        return False
    if (env.get("OTEL_TRACES_EXPORTER") or "").strip().lower() == "none":
        return False
    return bool(
        otlp_endpoint
        or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def _flag(raw: str | None, default: bool) -> bool:
    if raw is None or not raw.strip():
        return default
    return raw.strip().lower() not in _OFF


def _port(raw: str | None) -> int | None:
    if not raw or not raw.strip():
        return None
    port = int(raw)
    if not 0 < port < 65536:
        raise ValueError(f"KVLENS_METRICS_PORT must be a TCP port, got {raw!r}")
    return port


def _positive_int(raw: str | None, default: int) -> int:
    if not raw or not raw.strip():
        return default
    value = int(raw)
    if value <= 0:
        raise ValueError(f"expected a positive integer, got {raw!r}")
    return value
