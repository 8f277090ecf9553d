"""Telemetry of the scheduler half: lookup spans, lookup and load metrics, leak gauges,
per-response usage and failed-load events.

The connector calls it at a handful of points (lookup, allocation, plan, worker report,
finish, stats). Everything it needs it reads from the scheduler half's public state; it
never changes that state. When tracing and metrics are both off, each call is one flag check
(usage for responses is still kept: it is part of the API, not telemetry).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

from connector.engine.tracker import tokens_by_tier

from . import tracing as tr
from .events import EventLog, load_failed_event
from .metrics import LocalExporter, StatsBuffer, wire_key
from .settings import TelemetrySettings
from .usage import PARAMS_KEY, RequestUsage

if TYPE_CHECKING:
    from connector.engine.jobs import LoadOutcome, StepPlan, WorkerReport
    from connector.engine.tracker import LookupResult
    from connector.scheduler import ConnectorScheduler

logger = logging.getLogger("vllm.kvlens")

_NOOP = contextlib.nullcontext()
GAUGE_INTERVAL_S = 0.1  # gauges are sampled at most this often while requests run


def reason_kind(reason: str) -> str:
    """A bounded label for a failure reason ('missing: <name>' -> 'missing')."""
    kind = reason.split(":", 1)[0].strip()
    return kind if kind in ("missing", "corrupt") else "error"


@dataclasses.dataclass(slots=True)
class _Lookup:
    """Timing of a request's lookups until the last one becomes final."""

    start_ns: int
    end_ns: int
    attempts: int
    result: LookupResult | None


class _LookupTimer:
    __slots__ = ("_owner", "_request", "_start")

    def __init__(self, owner: SchedulerTelemetry, request: Any) -> None:
        self._owner, self._request = owner, request

    def __enter__(self) -> None:
        self._start = time.time_ns()

    def __exit__(self, *exc: object) -> None:
        self._owner._lookup_done(self._request.request_id, self._start, time.time_ns())


class SchedulerTelemetry:
    def __init__(
        self,
        scheduler: ConnectorScheduler,
        settings: TelemetrySettings,
        model_name: str,
        engine: str,
        block_size: int,
        recompute_on_failure: bool,
    ) -> None:
        self._sched = scheduler
        self._settings = settings
        self._tracing = settings.tracing
        self._exporter = _start_exporter(settings.metrics_port, model_name, engine, scheduler.tiers)
        self._metrics = settings.metrics or self._exporter is not None
        self._ship = settings.metrics  # hand stats to vLLM (else only the local exporter gets them)
        self._timed = self._tracing or self._metrics
        self._model, self._engine = model_name, engine
        self._block_size = block_size
        self._recompute = recompute_on_failure
        self._buffer = StatsBuffer()
        self._lookups: dict[str, _Lookup] = {}
        self._usage: dict[str, RequestUsage] = {}
        self._headers: dict[str, dict[str, str]] = {}
        self._late: dict[str, tuple[RequestUsage, dict[str, Any]]] = {}
        self._last_gauges: dict[str, float] = {}
        self._gauges_at = float("-inf")
        self._evictions_seen: dict[str, int] = {}
        self._events: EventLog | None = None

    def configure(self, tracing: bool, metrics: bool) -> None:
        """Switch telemetry at run time (the overhead benchmark compares both in one engine)."""
        self._tracing = tracing
        self._metrics = metrics or self._exporter is not None
        self._ship = metrics
        self._timed = self._tracing or self._metrics

    # ---- lookup -------------------------------------------------------------------------
    def lookup(self, request: Any) -> contextlib.AbstractContextManager[None]:
        """Wraps one lookup attempt (vLLM may ask several times before scheduling)."""
        return _LookupTimer(self, request) if self._timed else _NOOP

    def _lookup_done(self, rid: str, start_ns: int, end_ns: int) -> None:
        result = self._sched.lookups.get(rid)
        seen = self._lookups.get(rid)
        if seen is None:
            self._lookups[rid] = _Lookup(start_ns, end_ns, 1, result)
        else:
            seen.start_ns, seen.end_ns, seen.result = start_ns, end_ns, result
            seen.attempts += 1

    def after_alloc(self, request: Any) -> None:
        """The lookup is final: keep the usage record, count it, emit its span."""
        rid = request.request_id
        result = self._sched.lookups.get(rid)
        timing = self._lookups.pop(rid, None)
        if result is not None:
            self._lookup_final(request, result, timing, scheduled=True)

    def _lookup_final(
        self, request: Any, result: LookupResult, timing: _Lookup | None, scheduled: bool
    ) -> None:
        rid = request.request_id
        policy = self._sched.policies.get(rid)
        prompt = _prompt_tokens(request)
        planned = result.num_external_tokens if result.can_load else 0
        usage = self._usage.get(rid)
        if usage is None:
            self._usage[rid] = RequestUsage(
                prompt,
                result.vllm_cached_tokens,
                result.hit_tokens,
                planned,
                result.miss_reason,
                policy.save_skip_reason if policy else None,
            )
        else:  # resumed after preemption: a new lookup and maybe a new load
            usage.vllm_cached_tokens, usage.planned_tokens = result.vllm_cached_tokens, planned
            usage.load_reported = False
        if not self._timed:
            return
        by_tier = tokens_by_tier(result.hits, 0, result.hit_tokens)
        if self._metrics:
            self._count_lookup(prompt, result, by_tier, timing, policy)
        if self._tracing:
            headers = tr.trace_headers(request)
            if headers and scheduled:
                self._headers[rid] = headers
            self._lookup_span(rid, prompt, result, by_tier, timing, scheduled, headers, policy)

    def _count_lookup(
        self, prompt: int, result: LookupResult, by_tier: dict[str, int], timing: _Lookup | None, policy: Any
    ) -> None:
        b = self._buffer
        b.inc("lookup_requests")
        b.inc("lookup_tokens", prompt)
        b.inc("vllm_hit_tokens", result.vllm_cached_tokens)
        for tier, n in by_tier.items():
            b.inc(wire_key("hit_tokens", tier), n)
        if result.hit_tokens:
            b.inc("hit_requests")
        if result.miss_reason:
            b.inc(wire_key("miss_requests", result.miss_reason))
        if policy is not None and policy.save_skip_reason:
            b.inc(wire_key("save_skipped_requests", policy.save_skip_reason))
        b.observe("request_hit_ratio", min(result.hit_tokens / prompt, 1.0) if prompt else 0.0)
        if timing is not None:
            b.observe("operation_seconds|lookup", max(timing.end_ns - timing.start_ns, 0) / 1e9)

    def _lookup_span(
        self,
        rid: str,
        prompt: int,
        result: LookupResult,
        by_tier: dict[str, int],
        timing: _Lookup | None,
        scheduled: bool,
        headers: dict[str, str] | None,
        policy: Any,
    ) -> None:
        now = time.time_ns()
        start, end = (timing.start_ns, timing.end_ns) if timing is not None else (now, now)
        planned = result.num_external_tokens if result.can_load else 0

        def attributes() -> dict[str, Any]:
            attrs: dict[str, Any] = {
                tr.A_REQUEST_ID: rid,
                tr.A_MODEL: self._model,
                tr.A_PROMPT_TOKENS: prompt,
                tr.A_VLLM_CACHED_TOKENS: result.vllm_cached_tokens,
                tr.A_HIT_TOKENS: result.hit_tokens,
                tr.A_HIT_RATE: round(result.hit_tokens / prompt, 4) if prompt else 0.0,
                tr.A_EXTERNAL_TOKENS: planned,
                tr.A_CHUNKS: len(result.hits),
                tr.A_TIERS: sorted(by_tier),
                tr.A_CACHE_READ: result.vllm_cached_tokens + planned,
            }
            if timing is not None and timing.attempts > 1:
                attrs[tr.A_ATTEMPTS] = timing.attempts
            if not scheduled:
                attrs[tr.A_SCHEDULED] = False
            if result.miss_reason:
                attrs[tr.A_MISS_REASON] = result.miss_reason
            if policy is not None and policy.save_skip_reason:
                attrs[tr.A_SAVE_SKIP_REASON] = policy.save_skip_reason
            return attrs

        tr.emit(tr.LOOKUP, headers, start, end, attributes, otlp_endpoint=self._settings.otlp_endpoint)

    # ---- plan and worker reports --------------------------------------------------------
    def on_plan(self, plan: StepPlan) -> None:
        """Carry each request's trace context to the workers, in its load and store jobs."""
        self._late.clear()
        if not self._headers:
            return
        headers = self._headers
        plan.loads[:] = [
            dataclasses.replace(j, trace_context=headers[j.request_id])
            if j.request_id in headers and j.trace_context is None
            else j
            for j in plan.loads
        ]
        plan.stores[:] = [
            dataclasses.replace(j, trace_context=headers[j.request_id])
            if j.request_id in headers and j.trace_context is None
            else j
            for j in plan.stores
        ]

    def on_worker_report(self, report: WorkerReport) -> None:
        for rid, outcome in report.loads.items():
            late = self._late.pop(rid, None)
            usage = late[0] if late is not None else self._usage.get(rid)
            failed = len(outcome.failed_block_ids)
            if usage is not None:
                affected = usage.record_load(outcome.tokens_by_tier, outcome.seconds, failed)
            else:
                affected = failed * self._block_size
            if late is not None:  # finished in this same step: fill the response before it is sent
                late[1].update(usage.to_params() if usage is not None else {})
            if failed:
                self._load_failed(rid, outcome, affected)
            if self._metrics:
                self._count_load(outcome, failed, affected)
        if self._metrics:
            for _name, tier, reason in report.store_failures:
                self._buffer.inc(wire_key("failed_chunks", "store", tier, reason_kind(reason)))

    def _count_load(self, outcome: LoadOutcome, failed: int, affected: int) -> None:
        b = self._buffer
        if outcome.tokens_by_tier:
            b.inc("load_requests")
        for tier, n in outcome.tokens_by_tier.items():
            b.inc(wire_key("load_tokens", tier), n)
        b.inc("load_bytes", outcome.nbytes)
        b.observe("operation_seconds|load", outcome.seconds)
        for _name, tier, reason in outcome.failed_chunks:
            b.inc(wire_key("failed_chunks", "load", tier, reason_kind(reason)))
        if failed:
            first = outcome.failed_chunks[0][2] if outcome.failed_chunks else "error"
            b.inc("failed_load_requests")
            b.inc(wire_key("failed_blocks", reason_kind(first)), failed)
            if self._recompute:
                b.inc("recomputed_tokens", affected)

    def _load_failed(self, rid: str, outcome: LoadOutcome, affected: int) -> None:
        if self._events is None:
            s = self._settings
            self._events = EventLog(s.event_log, s.event_log_max_bytes, s.event_log_backups)
        tiers = list(dict.fromkeys(tier for _n, tier, _r in outcome.failed_chunks))
        reasons = list(dict.fromkeys(reason for _n, _t, reason in outcome.failed_chunks))
        self._events.append(
            load_failed_event(
                rid,
                tiers,
                outcome.failed_block_ids,
                affected,
                "; ".join(reasons) or "error",
                self._recompute,
                self._engine,
                self._model,
            )
        )

    # ---- finish -------------------------------------------------------------------------
    def finished(self, request: Any, params: dict[str, Any] | None) -> dict[str, Any] | None:
        """Close the request's records; adds the ``kvlens`` usage object to ``params``."""
        rid = request.request_id
        timing = self._lookups.pop(rid, None)
        if timing is not None and timing.result is not None:  # looked up, never scheduled
            self._lookup_final(request, timing.result, timing, scheduled=False)
        self._headers.pop(rid, None)
        usage = self._usage.pop(rid, None)
        if params is None or usage is None:
            return params
        details = usage.to_params()
        params[PARAMS_KEY] = details
        if usage.load_pending:
            self._late[rid] = (usage, details)
        return params

    # ---- stats --------------------------------------------------------------------------
    def stats(self) -> dict[str, Any] | None:
        """This step's payload for vLLM (None when empty or metrics are off)."""
        if not self._metrics:
            return None
        now = time.monotonic()
        if now - self._gauges_at >= GAUGE_INTERVAL_S or not self._sched.unfinished:
            self._gauges_at = now  # exact whenever nothing runs, so a drained engine shows zeros
            self._sample_gauges()
        self._count_evictions()
        data = self._buffer.take()
        if data is not None and self._exporter is not None:
            self._exporter.observe(data)
        return data if self._ship else None

    def on_worker_stats(self, data: dict[str, Any] | None) -> None:
        """Worker payloads reach vLLM's /metrics by themselves; the offline exporter needs them."""
        if data and self._exporter is not None:
            self._exporter.observe(data)

    def _sample_gauges(self) -> None:
        sizes = self._sched.sizes()
        gauges: dict[str, float] = {
            "request_trackers": sizes.get("request_trackers", 0),
            "load_specs": sizes.get("load_specs", 0),
            "unfinished_requests": sizes.get("unfinished_requests", 0),
            "pinned_requests": sizes.get("pinned_requests", 0),
            "pending_saves": sum(
                1 for t in self._sched.trackers.values() if t.save_skip_reason is None and not t.prefill_done
            ),
            "telemetry_open_requests": len(self._usage) + len(self._lookups) + len(self._headers),
        }
        for name, tier in self._sched.tiers.items():
            gauges["pinned_chunks|" + name] = tier.pinned_keys
            gauges["pinned_bytes|" + name] = tier.pinned_bytes
            gauges["tier_chunks|" + name] = len(tier)
            gauges["tier_used_bytes|" + name] = tier.used_bytes
            gauges["tier_capacity_bytes|" + name] = tier.capacity_bytes
        last = self._last_gauges
        for key, value in gauges.items():
            if last.get(key) != value:
                last[key] = value
                self._buffer.set(key, value)

    def _count_evictions(self) -> None:
        for name, tier in self._sched.tiers.items():
            seen = self._evictions_seen.get(name, 0)
            if tier.evictions != seen:
                self._buffer.inc("evictions|" + name, max(tier.evictions - seen, 0))
                self._evictions_seen[name] = tier.evictions

    def shutdown(self) -> None:
        if self._tracing:
            tr.flush()
        if self._exporter is not None:
            self._exporter.close()
            self._exporter = None


def _start_exporter(port: int | None, model: str, engine: str, tiers: Any) -> LocalExporter | None:
    """The optional localhost exporter; a busy port costs the exporter, never the engine."""
    if not port:
        return None
    try:
        return LocalExporter(port, model, engine, tiers)
    except OSError as e:
        logger.warning("KVLens: no metrics exporter on 127.0.0.1:%d: %s", port, e)
        return None


def _prompt_tokens(request: Any) -> int:
    n = getattr(request, "num_prompt_tokens", None)
    if n is None:
        n = len(getattr(request, "prompt_token_ids", None) or ())
    return int(n)
