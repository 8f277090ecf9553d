"""Telemetry of a worker: load and store spans, remote round trips, this rank's gauges.

A load span is cut per request out of the step's loads. A request's stores spread over
several steps (chunked prefill, decode saves); they accumulate into one record that becomes
one ``kvlens.store`` span and one store-latency observation when the worker learns the
request finished (``get_finished``) or at shutdown. What the tiers hold and the bytes moved
are counted by the scheduler's recorder from the workers' report, once a write has landed
(``SchedulerRecorder.traffic_reported``). Gauges are reported per rank and summed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import remote_calls
from . import tracing as tr
from .encoding import worker_gauges
from .metrics import StatsBuffer, rank_key
from .settings import TelemetrySettings

if TYPE_CHECKING:
    from connector.engine.blend_jobs import BlendJob
    from connector.engine.jobs import LoadJob, StepPlan
    from connector.engine.outcomes import BlendOutcome, LoadOutcome, StoreFailure
    from connector.engine.snapshots import WorkerSizes

MAX_OPEN_STORE_RECORDS = 100_000  # safety net: a request never reported finished


@dataclass(slots=True)
class StoreRecord:
    start_ns: int
    end_ns: int
    headers: dict[str, str] | None
    chunks: int = 0
    tokens: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    steps: int = 0
    failed_chunks: int = 0
    tiers: set[str] = field(default_factory=set)


class WorkerRecorder:
    def __init__(
        self,
        settings: TelemetrySettings,
        rank: int,
        block_nbytes: int,
        sizes: Callable[[], WorkerSizes] | None = None,
        background_calls: Callable[[], list[Any]] | None = None,
    ) -> None:
        self._settings = settings
        self._tracing = settings.tracing
        self._metrics = settings.metrics
        self._on = self._tracing or self._metrics
        self._rank = rank
        self._counts_tokens = rank == 0
        self._block_nbytes = block_nbytes  # one block of every layer, this rank
        self._sizes = sizes
        self._background_calls = background_calls  # remote writes done off the step loop
        self._buffer = StatsBuffer()
        self._last_gauges: dict[str, float] = {}
        self.stores: dict[str, StoreRecord] = {}  # open store records, by request

    def configure(self, tracing: bool, metrics: bool) -> None:
        """Switch telemetry at run time (the overhead benchmark compares both in one engine)."""
        self._tracing, self._metrics = tracing, metrics
        self._on = tracing or metrics

    def now(self) -> int:
        return time.time_ns() if self._on else 0

    # ---- loads --------------------------------------------------------------------------
    def loaded(self, plan: StepPlan, outcomes: Sequence[LoadOutcome] | None, started_ns: int) -> None:
        """One span per load job; the jobs ran one after another from ``started_ns``."""
        if self._metrics and outcomes:
            for outcome in outcomes:
                remote_calls.count(self._buffer, outcome.remote_calls)
        if not self._tracing or not plan.loads or not outcomes:
            return
        t = started_ns
        for job, outcome in zip(plan.loads, outcomes, strict=False):
            end = t + int(outcome.seconds * 1e9)
            self._load_span(job, outcome, t, end)
            t = end

    def blended(self, jobs: Sequence[BlendJob], outcomes: Sequence[BlendOutcome], started_ns: int) -> None:
        """One ``kvlens.blend`` span per blended request; they ran one after another."""
        if not self._tracing:
            return
        t = started_ns
        for job, outcome in zip(jobs, outcomes, strict=False):
            end = t + int(outcome.seconds * 1e9)

            def attributes(job: BlendJob = job, outcome: BlendOutcome = outcome) -> dict[str, Any]:
                attrs: dict[str, Any] = {
                    tr.A_REQUEST_ID: job.request_id,
                    tr.A_PROMPT_TOKENS: outcome.tokens,
                    tr.A_REUSED_TOKENS: outcome.reused,
                    tr.A_RECOMPUTED_TOKENS: outcome.recomputed,
                    tr.A_BY_DEVIATION: outcome.by_deviation,
                    tr.A_TIERS: sorted(outcome.reused_by_tier),
                    tr.A_FAILED_CHUNKS: len(outcome.problems),
                    tr.A_FAILED_BLOCKS: len(outcome.failed_block_ids),
                }
                if outcome.deviation_mean is not None:
                    attrs[tr.A_DEVIATION_MEAN] = outcome.deviation_mean
                    attrs[tr.A_DEVIATION_MAX] = outcome.deviation_max or 0.0
                if self._rank:
                    attrs[tr.A_RANK] = self._rank
                return attrs

            tr.emit(
                tr.BLEND,
                job.trace_context,
                t,
                end,
                attributes,
                outcome.failed,
                otlp_endpoint=self._settings.otlp_endpoint,
            )
            t = end

    def _load_span(self, job: LoadJob, outcome: LoadOutcome, start: int, end: int) -> None:
        failed = len(outcome.failed_block_ids)
        failures = outcome.failures()
        reasons = list(
            dict.fromkeys(f"{c.reason.value}: {c.detail}" if c.detail else c.reason.value for c in failures)
        )
        by_tier = outcome.tokens_by_tier()

        def attributes() -> dict[str, Any]:
            attrs: dict[str, Any] = {
                tr.A_REQUEST_ID: job.request_id,
                tr.A_PLANNED_TOKENS: sum(c.num_tokens for c in job.chunks),
                tr.A_LOADED_TOKENS: sum(by_tier.values()),
                tr.A_BYTES: outcome.nbytes,
                tr.A_CHUNKS: len(job.chunks),
                tr.A_BLOCKS: sum(len(c.block_ids) for c in job.chunks),
                tr.A_TIERS: sorted(by_tier),
                tr.A_FAILED_BLOCKS: failed,
            }
            if len(by_tier) > 1:
                for tier, n in by_tier.items():
                    attrs[f"{tr.A_LOADED_TOKENS}.{tier}"] = n
            if failures:
                attrs[tr.A_FAILED_CHUNKS] = len(failures)
            if self._rank:
                attrs[tr.A_RANK] = self._rank
            return attrs

        events = []
        error = None
        if failed:
            error = failures[0].reason.value if failures else "not_loadable"
            events.append(
                (
                    "kvlens.load_failed",
                    {
                        tr.A_BLOCK_IDS: list(outcome.failed_block_ids),
                        tr.A_REASON: "; ".join(reasons) or "not_loadable",
                        tr.A_TIERS: sorted({c.planned_tier for c in failures}),
                    },
                )
            )
        tr.emit(
            tr.LOAD,
            job.trace_context,
            start,
            end,
            attributes,
            error,
            events,
            otlp_endpoint=self._settings.otlp_endpoint,
            children=remote_calls.child_spans(outcome.remote_calls),
        )

    # ---- stores -------------------------------------------------------------------------
    def saved(self, plan: StepPlan, started_ns: int, failures: Iterable[StoreFailure] | None) -> None:
        """Account the step's stores; the step's time is shared among its jobs by bytes."""
        stores = plan.stores
        if not self._on or not stores:
            return
        end_ns = time.time_ns()
        failed = {(f.name, f.tier) for f in failures or ()}
        sizes = [len(job.block_ids) * self._block_nbytes for job in stores]
        total = sum(sizes) or 1
        elapsed = max(end_ns - started_ns, 0)
        seen: set[str] = set()
        t = started_ns
        for job, nbytes in zip(stores, sizes, strict=True):
            duration = elapsed * nbytes // total
            ok = [tier for tier in job.tiers if (job.name, tier) not in failed]
            self._record_store(job, nbytes, ok, t, t + duration, job.request_id not in seen)
            seen.add(job.request_id)
            t += duration

    def _record_store(
        self, job: Any, nbytes: int, ok: list[str], start: int, end: int, new_step: bool
    ) -> None:
        record = self.stores.get(job.request_id)
        if record is None:
            if len(self.stores) >= MAX_OPEN_STORE_RECORDS:
                oldest = next(iter(self.stores))
                self._close_store(oldest, self.stores.pop(oldest))
            record = self.stores[job.request_id] = StoreRecord(start, end, job.trace_context)
        if record.headers is None:
            record.headers = job.trace_context
        if new_step:
            record.steps += 1
        record.end_ns = end
        record.seconds += (end - start) / 1e9
        if ok:
            record.chunks += 1
            record.tokens += job.num_tokens
            record.nbytes += nbytes * len(ok)
            record.tiers.update(ok)
        if len(ok) < len(job.tiers):
            record.failed_chunks += 1

    def finished(self, request_ids: Iterable[str] | None) -> None:
        """Requests vLLM finished: their store records are complete."""
        if not self.stores or not request_ids:
            return
        for rid in request_ids:
            record = self.stores.pop(rid, None)
            if record is not None:
                self._close_store(rid, record)

    def _close_store(self, rid: str, record: StoreRecord) -> None:
        if self._metrics:
            self._buffer.observe("operation_seconds|store", record.seconds)
        if self._tracing:
            self._store_span(rid, record)

    def _store_span(self, rid: str, record: StoreRecord) -> None:
        def attributes() -> dict[str, Any]:
            attrs: dict[str, Any] = {
                tr.A_REQUEST_ID: rid,
                tr.A_STORED_TOKENS: record.tokens,
                tr.A_CHUNKS: record.chunks,
                tr.A_BYTES: record.nbytes,
                tr.A_TIERS: sorted(record.tiers),
                tr.A_STEPS: record.steps,
                tr.A_STORE_SECONDS: round(record.seconds, 6),
            }
            if record.failed_chunks:
                attrs[tr.A_FAILED_CHUNKS] = record.failed_chunks
            if self._rank:
                attrs[tr.A_RANK] = self._rank
            return attrs

        error = "store_failed" if record.failed_chunks else None
        tr.emit(
            tr.STORE,
            record.headers,
            record.start_ns,
            record.end_ns,
            attributes,
            error,
            otlp_endpoint=self._settings.otlp_endpoint,
        )

    # ---- stats and shutdown -------------------------------------------------------------
    def stats(self) -> dict[str, Any] | None:
        if not self._metrics:
            return None
        if self._background_calls is not None:
            remote_calls.count(self._buffer, self._background_calls())
        # Every step (a few attribute reads): the step before the engine idles may be its last.
        if self._sizes is not None:
            for key, value in worker_gauges(self._sizes()).items():
                if self._last_gauges.get(key) != value:
                    self._last_gauges[key] = value
                    self._buffer.set(rank_key(key, self._rank), value)
        return self._buffer.take()

    def shutdown(self) -> None:
        for rid in list(self.stores):
            self._close_store(rid, self.stores.pop(rid))
        if self._tracing:
            tr.flush()
