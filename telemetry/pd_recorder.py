"""PD's numbers and spans, recorded in the scheduler process of a prefiller or a decoder.

The connector (connector/pd_roles.py) tells it what ended: a prefiller rank's transfer
(``send_ended``), the decoder's finished transfers (``received``), a decoder request's load
(``load_reported``), and the receive buffer's sizes each time stats go out (``sample``). It
fills a ``StatsBuffer`` for the ``vllm:kvlens_pd_*`` series and emits the spans
``kvlens.pd.send`` (prefiller) and ``kvlens.pd.receive`` (decoder) in the request's trace.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from . import tracing as tr
from .metrics import StatsBuffer, wire_key
from .settings import TelemetrySettings

SEND_SPAN = "kvlens.pd.send"
RECEIVE_SPAN = "kvlens.pd.receive"


def _reason(reason: str | None) -> str:
    """A bounded label: ``mismatch:tp_size,block_size`` counts as ``mismatch``."""
    return (reason or "unknown").split(":", 1)[0][:40]


class PDRecorder:
    def __init__(self, settings: TelemetrySettings) -> None:
        self._settings = settings
        self._buffer = StatsBuffer()

    # ---- prefiller ---------------------------------------------------------------------------
    def send_ended(
        self,
        trace_context: Mapping[str, str] | None,
        req_id: str,
        ok: bool,
        reason: str | None,
        nbytes: int,
        tokens: int,
        seconds: float,
        peer: str,
        rank: int,
    ) -> None:
        b = self._buffer
        b.inc(wire_key("pd_transfers", "send", "ok" if ok else "failed"))
        if ok:
            b.inc("pd_sent_bytes", nbytes)
            b.observe("pd_send_seconds", seconds)
        else:
            b.inc(wire_key("pd_failed_transfers", "send", _reason(reason)))
        if self._settings.tracing and trace_context:
            end = time.time_ns()
            attributes = {
                "kvlens.pd.req_id": req_id,
                "kvlens.pd.bytes": nbytes,
                "kvlens.pd.tokens": tokens,
                "kvlens.pd.outcome": "ok" if ok else "failed",
                "kvlens.pd.reason": reason or "",
                "kvlens.pd.peer": peer,
                tr.A_RANK: rank,
            }
            tr.emit(
                SEND_SPAN,
                trace_context,
                end - int(seconds * 1e9),
                end,
                lambda: attributes,
                error=None if ok else (reason or "failed"),
                otlp_endpoint=self._settings.otlp_endpoint,
            )

    def spec_refused(self, reason: str, count: int = 1) -> None:
        self._buffer.inc(wire_key("pd_failed_transfers", "send", "spec_refused:" + _reason(reason)), count)

    # ---- decoder -----------------------------------------------------------------------------
    def received(self, finished: list[Any], outcomes: Mapping[str, int], failures: Mapping[str, int]) -> None:
        """The receiver's finished transfers (``FinishedTransfer``: ok, bytes, seconds) and, since the
        last call, its transfers by outcome and failures by reason (refused handshakes included)."""
        b = self._buffer
        for t in finished:
            if t.ok:
                b.inc("pd_received_bytes", t.bytes)
                b.observe("pd_receive_seconds", t.seconds)
        for outcome, n in outcomes.items():
            b.inc(wire_key("pd_transfers", "receive", "ok" if outcome == "ok" else "failed"), n)
        for reason, n in failures.items():
            b.inc(wire_key("pd_failed_transfers", "receive", _reason(reason)), n)

    def load_reported(self, trace_context: Mapping[str, str] | None, pd: Mapping[str, Any]) -> None:
        """A decoder request's load ended (``pd`` is its response's ``kvlens.pd``)."""
        b = self._buffer
        b.inc(wire_key("pd_loads", pd["outcome"]))
        if pd["outcome"] == "loaded":
            b.inc("pd_loaded_tokens", pd["tokens"])
        if pd["outcome"] == "failed":
            b.inc(wire_key("pd_failed_transfers", "receive", _reason(pd.get("reason"))))
        b.observe("pd_notify_wait_seconds", pd["notify_wait_ms"] / 1000)
        if self._settings.tracing and trace_context:
            end = time.time_ns()
            start = end - int((pd["buffer_ms"] + pd["transfer_ms"]) * 1e6)
            attributes = {
                "kvlens.pd.bytes": pd["bytes"],
                "kvlens.pd.tokens": pd["tokens"],
                "kvlens.pd.transfer_ms": pd["transfer_ms"],
                "kvlens.pd.notify_wait_ms": pd["notify_wait_ms"],
                "kvlens.pd.buffer_ms": pd["buffer_ms"],
                "kvlens.pd.outcome": pd["outcome"],
                "kvlens.pd.reason": pd.get("reason") or "",
            }
            tr.emit(
                RECEIVE_SPAN,
                trace_context,
                start,
                end,
                lambda: attributes,
                error=pd.get("reason") if pd["outcome"] == "failed" else None,
                otlp_endpoint=self._settings.otlp_endpoint,
            )

    def expired(self, n: int) -> None:
        self._buffer.inc(wire_key("pd_loads", "expired"), n)

    def sample(self, receiver_stats: Any, send_in_flight: int | None) -> None:
        """Gauges: the receive buffer (decoder) and transfers in flight."""
        b = self._buffer
        if receiver_stats is not None:
            b.set("pd_buffer_used_bytes", receiver_stats.used_bytes)
            b.set("pd_buffer_capacity_bytes", receiver_stats.capacity_bytes)
            b.set("pd_buffer_entries", receiver_stats.entries)
            b.set(wire_key("pd_transfers_in_flight", "receive"), receiver_stats.in_flight)
        if send_in_flight is not None:
            b.set(wire_key("pd_transfers_in_flight", "send"), send_in_flight)

    def take(self) -> dict[str, Any] | None:
        return self._buffer.take() if self._settings.metrics else None


def pd_recorder(vllm_config: Any) -> PDRecorder:
    return PDRecorder(TelemetrySettings.from_env(vllm_config.observability_config.otlp_traces_endpoint))
