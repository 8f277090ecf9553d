"""Telemetry of the scheduler half: lookup spans, lookup and load metrics, leak gauges and
failed-load events.

It consumes the connector's typed outcomes (``LookupOutcome``, ``LoadOutcome``,
``StoreFailure``) and size snapshots, handed over by the connector's facade; it never reads
the connector's internals and never changes what the connector does. When tracing and
metrics are both off, each call is one flag check.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import remote_calls
from . import tracing as tr
from .encoding import retention_counts, scheduler_gauges, tenant_counters, tenant_gauges
from .events import EventLog, load_failed_event
from .metrics import LocalExporter, StatsBuffer, wire_key
from .request_log import RequestLog, request_record
from .settings import TelemetrySettings

if TYPE_CHECKING:  # the connector's outcome types; telemetry only reads their fields
    from connector.engine.outcomes import (
        BlendOutcome,
        LoadOutcome,
        LookupOutcome,
        RequestSummary,
        StoreFailure,
        TierTraffic,
    )
    from connector.engine.snapshots import InsightSnapshot, KnownLabels, SchedulerSizes
    from connector.engine.tenants import TenantUsage

logger = logging.getLogger("vllm.kvlens")

_NOOP = contextlib.nullcontext()
_MAX_OPEN = 100_000
GAUGE_INTERVAL_S = 0.1  # gauges are sampled at most this often while requests run


@dataclass(slots=True)
class _Timing:
    start_ns: int
    end_ns: int


class _LookupTimer:
    __slots__ = ("_owner", "_rid", "_start")

    def __init__(self, owner: SchedulerRecorder, rid: str) -> None:
        self._owner, self._rid = owner, rid

    def __enter__(self) -> None:
        self._start = time.time_ns()

    def __exit__(self, *exc: object) -> None:
        timings = self._owner._timings
        seen = timings.get(self._rid)
        if seen is None:
            timings[self._rid] = _Timing(self._start, time.time_ns())
        else:  # vLLM asked again (the request waited): the span covers the last attempt
            seen.start_ns, seen.end_ns = self._start, time.time_ns()


class SchedulerRecorder:
    def __init__(
        self,
        settings: TelemetrySettings,
        model_name: str,
        engine: str,
        block_size: int,
        recompute_on_failure: bool,
        known: KnownLabels | None = None,
    ) -> None:
        self._settings = settings
        self._exporter = _start_exporter(settings.metrics_port, model_name, engine, known)
        self._model, self._engine = model_name, engine
        self._block_size = block_size
        self._recompute = recompute_on_failure
        self._buffer = StatsBuffer()
        self._timings: dict[str, _Timing] = {}
        self._last_gauges: dict[str, float] = {}
        self._counted_totals: dict[str, int] = {}  # retention counters' totals already counted
        self._gauges_at = float("-inf")
        self._events: EventLog | None = None
        self._requests = RequestLog.from_settings(settings)  # None: the request log is off
        self._lookup_ms: dict[str, float] = {}  # kept for the request log only
        self.configure(settings.tracing, settings.metrics)

    def configure(self, tracing: bool, metrics: bool) -> None:
        """Switch telemetry at run time (the overhead benchmark compares both in one engine)."""
        self._tracing = tracing
        self._metrics = metrics or self._exporter is not None
        self._ship = metrics  # hand stats to vLLM (else only the local exporter gets them)
        self._timed = self._tracing or self._metrics or self._requests is not None

    # ---- lookups ------------------------------------------------------------------------
    def lookup(self, request_id: str) -> contextlib.AbstractContextManager[None]:
        """Wraps one lookup attempt (vLLM may ask several times before scheduling)."""
        return _LookupTimer(self, request_id) if self._timed else _NOOP

    def lookup_final(self, outcome: LookupOutcome | None) -> None:
        """A lookup is final (scheduled, or its request finished unscheduled)."""
        if outcome is None:
            return
        timing = self._timings.pop(outcome.request_id, None)
        if not self._timed:
            return
        if self._requests is not None and timing is not None and not outcome.resumed:
            if len(self._lookup_ms) >= _MAX_OPEN:
                self._lookup_ms.clear()  # summaries that never came: bounded, never a leak
            self._lookup_ms[outcome.request_id] = (timing.end_ns - timing.start_ns) / 1e6
        if self._metrics and not outcome.resumed:  # a preempted request is counted once
            self._count_lookup(outcome, timing)
        if self._metrics:
            remote_calls.count(self._buffer, outcome.remote_calls)
        if self._tracing:
            self._lookup_span(outcome, timing)

    def _count_lookup(self, o: LookupOutcome, timing: _Timing | None) -> None:
        b = self._buffer
        b.inc("lookup_requests")
        b.inc("lookup_tokens", o.prompt_tokens)
        b.inc("vllm_hit_tokens", o.vllm_cached_tokens)
        for tier, n in o.hit_tokens_by_tier.items():
            b.inc(wire_key("hit_tokens", tier), n)
        if o.hit_tokens:
            b.inc("hit_requests")
        if o.miss_reason is not None:
            b.inc(wire_key("miss_requests", o.miss_reason.value))
        if o.save_skip_reason is not None:
            b.inc(wire_key("save_skipped_requests", o.save_skip_reason.value))
        b.inc("ignored_request_params", o.ignored_params)
        if o.retention_refused is not None:
            b.inc(wire_key("retention_refused_requests", o.retention_refused))
        b.observe("request_hit_ratio", min(o.hit_tokens / o.prompt_tokens, 1.0) if o.prompt_tokens else 0.0)
        if timing is not None:
            b.observe("operation_seconds|lookup", max(timing.end_ns - timing.start_ns, 0) / 1e9)

    def _lookup_span(self, o: LookupOutcome, timing: _Timing | None) -> None:
        now = time.time_ns()
        start, end = (timing.start_ns, timing.end_ns) if timing is not None else (now, now)

        def attributes() -> dict[str, Any]:
            attrs: dict[str, Any] = {
                tr.A_REQUEST_ID: o.request_id,
                tr.A_MODEL: self._model,
                tr.A_PROMPT_TOKENS: o.prompt_tokens,
                tr.A_VLLM_CACHED_TOKENS: o.vllm_cached_tokens,
                tr.A_HIT_TOKENS: o.hit_tokens,
                tr.A_HIT_RATE: round(o.hit_tokens / o.prompt_tokens, 4) if o.prompt_tokens else 0.0,
                tr.A_EXTERNAL_TOKENS: o.external_tokens,
                tr.A_CHUNKS: o.chunks,
                tr.A_TIERS: sorted(o.hit_tokens_by_tier),
                tr.A_CACHE_READ: o.vllm_cached_tokens + o.external_tokens,
            }
            if o.attempts > 1:
                attrs[tr.A_ATTEMPTS] = o.attempts
            if not o.scheduled:
                attrs[tr.A_SCHEDULED] = False
            if o.resumed:
                attrs[tr.A_RESUMED] = True
            if o.miss_reason is not None:
                attrs[tr.A_MISS_REASON] = o.miss_reason.value
            if o.save_skip_reason is not None:
                attrs[tr.A_SAVE_SKIP_REASON] = o.save_skip_reason.value
            return attrs

        tr.emit(
            tr.LOOKUP, o.trace_context, start, end, attributes, otlp_endpoint=self._settings.otlp_endpoint
        )

    # ---- worker reports -----------------------------------------------------------------
    def loads_reported(
        self,
        loads: Mapping[str, LoadOutcome],
        recomputed: Mapping[str, int],
        store_failures: list[StoreFailure],
    ) -> None:
        """The workers' merged report of one step: loads (with the tokens vLLM recomputes)."""
        for rid, outcome in loads.items():
            affected = recomputed.get(rid, 0)
            if outcome.failed_block_ids:
                self._load_failed(rid, outcome, affected)
            if self._metrics:
                self._count_load(outcome, affected)
        if self._metrics:
            for f in store_failures:
                self._buffer.inc(wire_key("failed_chunks", "store", f.tier, f.reason.value))

    def blends_reported(self, blends: Mapping[str, BlendOutcome]) -> None:
        """The step's blended requests: outcome, tokens by kind, recomputed share, deviation; the
        chunks a blend could not read count as failed chunk loads."""
        if not self._metrics:
            return
        b = self._buffer
        for outcome in blends.values():
            b.inc(wire_key("blend_requests", "failed" if outcome.failed else "blended"))
            for problem in outcome.problems:
                b.inc(wire_key("failed_chunks", "load", problem.tier, problem.reason.value))
            if outcome.failed or not outcome.tokens:
                continue
            b.inc(wire_key("blend_tokens", "reused"), outcome.reused)
            b.inc(wire_key("blend_tokens", "recomputed"), outcome.recomputed)
            b.inc(wire_key("blend_tokens", "recomputed_by_deviation"), outcome.by_deviation)
            b.inc(wire_key("blend_tokens", "not_stored"), outcome.not_reused)
            b.observe("blend_recomputed_ratio", outcome.recomputed / outcome.tokens)
            if outcome.deviation_mean is not None:
                b.observe("blend_deviation", outcome.deviation_mean)

    def traffic_reported(self, traffic: Mapping[str, TierTraffic]) -> None:
        """Stores the tiers now hold and the bytes that moved for them, from the workers' report."""
        if not self._metrics:
            return
        b = self._buffer
        for tier, t in traffic.items():
            b.inc(wire_key("store_chunks", tier), t.stored_chunks)
            b.inc(wire_key("store_tokens", tier), t.stored_tokens)
            b.inc(wire_key("store_bytes", tier), t.stored_bytes)
            for stage, moved in t.moved.items():
                b.inc(wire_key("transfer_bytes", stage.value, tier), moved.nbytes)
                b.inc(wire_key("transfer_seconds", stage.value, tier), moved.seconds)

    def _count_load(self, outcome: LoadOutcome, affected: int) -> None:
        b = self._buffer
        by_tier = outcome.tokens_by_tier()
        if by_tier:
            b.inc("load_requests")
        for tier, n in by_tier.items():
            b.inc(wire_key("load_tokens", tier), n)
        b.inc("load_bytes", outcome.nbytes)
        if outcome.rank_disagreements:
            b.inc("rank_disagreements", outcome.rank_disagreements)
        b.observe("operation_seconds|load", outcome.seconds)
        for chunk in outcome.failures():
            b.inc(wire_key("failed_chunks", "load", chunk.planned_tier, chunk.reason.value))
        if outcome.failed_block_ids:
            first = outcome.failures()
            reason = first[0].reason.value if first else "not_loadable"
            b.inc("failed_load_requests")
            b.inc(wire_key("failed_blocks", reason), len(outcome.failed_block_ids))
            if self._recompute:
                b.inc("recomputed_tokens", affected)

    def _load_failed(self, rid: str, outcome: LoadOutcome, affected: int) -> None:
        if self._events is None:
            s = self._settings
            self._events = EventLog(s.event_log, s.event_log_max_bytes, s.event_log_backups)
        failures = outcome.failures()
        tiers = list(dict.fromkeys(c.planned_tier for c in failures))
        reasons = list(
            dict.fromkeys(f"{c.reason.value}: {c.detail}" if c.detail else c.reason.value for c in failures)
        )
        self._events.append(
            load_failed_event(
                rid,
                tiers,
                outcome.failed_block_ids,
                affected if self._recompute else len(outcome.failed_block_ids) * self._block_size,
                "; ".join(reasons) or "not_loadable",
                self._recompute,
                self._engine,
                self._model,
            )
        )

    # ---- finish and stats ---------------------------------------------------------------
    def finished(self, request_id: str, unscheduled: LookupOutcome | None) -> None:
        if unscheduled is not None:
            self.lookup_final(unscheduled)
        self._timings.pop(request_id, None)

    def requests_done(self, summaries: list[RequestSummary]) -> None:
        """Finished requests: one request-log line each (sampled), when the log is on."""
        log = self._requests
        if log is None:
            return
        for summary in summaries:
            rid = summary.request_id
            lookup_ms = self._lookup_ms.pop(rid, 0.0)
            if log.wants(rid):
                log.append(_request_line(summary, lookup_ms, self._engine, self._model))

    def stats(
        self,
        sizes: SchedulerSizes,
        insight: Callable[[], InsightSnapshot] | None,
        idle: bool,
        evictions: Mapping[str, int],
        saved_seconds: Mapping[str, float] | None = None,
        tenants: TenantUsage | None = None,
    ) -> dict[str, Any] | None:
        """This step's payload for vLLM (None when empty or metrics are off). ``insight`` is
        asked only when gauges are sampled; ``evictions`` and ``saved_seconds`` (estimated
        prefill seconds saved) are per tier, since the last call; ``tenants``: per tenant."""
        if not self._metrics:
            return None
        now = time.monotonic()
        if now - self._gauges_at >= GAUGE_INTERVAL_S or idle:
            self._gauges_at = now  # exact whenever nothing runs, so a drained engine shows zeros
            open_requests = len(self._timings) + len(self._lookup_ms)
            snapshot = insight() if insight is not None else None
            self._set_gauges({**scheduler_gauges(sizes, snapshot), "telemetry_open_requests": open_requests})
        for tier, n in evictions.items():
            self._buffer.inc(wire_key("evictions", tier), n)
        self._count_growth(retention_counts(sizes))
        for tier, seconds in (saved_seconds or {}).items():  # 0: the cost is known, nothing saved yet
            key = wire_key("prefill_seconds_saved", tier)
            self._buffer.inc(key, seconds) if seconds else self._buffer.touch(key)
        if tenants is not None:
            for key, n in tenant_counters(tenants).items():
                self._buffer.inc(key, n)
            self._set_gauges(tenant_gauges(tenants))
        data = self._buffer.take()
        if data is not None and self._exporter is not None:
            self._exporter.observe(data)
        return data if self._ship else None

    def _count_growth(self, totals: Mapping[str, int]) -> None:
        """Counters the connector reports as totals since start-up: add what each grew by."""
        seen = self._counted_totals
        for key, total in totals.items():
            if total > seen.get(key, 0):
                self._buffer.inc(key, total - seen.get(key, 0))
                seen[key] = total

    def _set_gauges(self, gauges: Mapping[str, float]) -> None:
        last = self._last_gauges
        for key, value in gauges.items():
            if last.get(key) != value:
                last[key] = value
                self._buffer.set(key, value)

    def on_worker_stats(self, data: dict[str, Any] | None) -> None:
        """Worker payloads reach vLLM's /metrics by themselves; the offline exporter needs them."""
        if data and self._exporter is not None:
            self._exporter.observe(data)

    def shutdown(self) -> None:
        if self._tracing:
            tr.flush()
        if self._exporter is not None:
            self._exporter.close()
            self._exporter = None


def _start_exporter(
    port: int | None, model: str, engine: str, known: KnownLabels | None
) -> LocalExporter | None:
    """The optional localhost exporter; a busy port costs the exporter, never the engine."""
    if not port:
        return None
    try:
        return LocalExporter(port, model, engine, known)
    except OSError as e:
        logger.warning("KVLens: no metrics exporter on 127.0.0.1:%d: %s", port, e)
        return None


def _request_line(summary: RequestSummary, lookup_ms: float, engine: str, model: str) -> dict[str, Any]:
    parent = (summary.trace_context or {}).get("traceparent", "")
    parts = parent.split("-")
    return request_record(
        request_id=summary.request_id,
        engine=engine,
        model=model,
        prompt_tokens=summary.prompt_tokens,
        vllm_cached_tokens=summary.vllm_cached_tokens,
        kvlens_tokens_by_tier=summary.loaded_tokens,
        lookup_ms=lookup_ms,
        miss_reason=summary.miss_reason,
        miss_detail=summary.miss_detail,
        load_ms=summary.load_seconds * 1000 if summary.load_seconds is not None else None,
        stored_chunks=summary.stored_chunks,
        failed=summary.failed_blocks > 0,
        failure_reasons=summary.failure_reasons,
        trace_id=parts[1] if len(parts) == 4 else None,
        blend=summary.blend,
    )
