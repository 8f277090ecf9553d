"""The decoder's PD numbers: a load that loaded counts its prompt tokens as KV a prefiller
supplied (vllm:kvlens_pd_loaded_tokens_total); a failed one counts none."""

from __future__ import annotations

from telemetry.pd_recorder import PDRecorder
from telemetry.settings import TelemetrySettings


def _pd(outcome: str, tokens: int, reason: str | None = None) -> dict:
    return {
        "role": "receiver",
        "outcome": outcome,
        "reason": reason,
        "tokens": tokens,
        "bytes": tokens * 2048,
        "transfer_ms": 1.0,
        "notify_wait_ms": 2.0,
        "buffer_ms": 3.0,
    }


def test_loaded_tokens_are_counted_and_failed_loads_count_none():
    rec = PDRecorder(TelemetrySettings.from_env(env={"KVLENS_TRACING": "0"}))
    rec.load_reported(None, _pd("loaded", 867))
    rec.load_reported(None, _pd("failed", 0, "load_failed"))
    rec.load_reported(None, _pd("loaded", 133))
    counters = rec.take()["counters"]
    assert counters["pd_loaded_tokens"] == 1000
    assert {k: v for k, v in counters.items() if k.startswith("pd_loads")} == {
        "pd_loads|loaded": 2,
        "pd_loads|failed": 1,
    }
