"""Applies the workers' reports to the scheduler's state, so the index keeps agreeing with
the tiers: a chunk whose load found it damaged or missing (and every later chunk of that
prefix in the same tier) or that failed to store leaves the index and is deleted (a slow or
failing read keeps it); blocks whose KV may be wrong become
suspect; pins of reported loads are released; an eviction a tier declined is indexed again;
an eviction counts when a delete removed the file (on a shared disk, only one engine's does).
"""

from __future__ import annotations

from ..engine.jobs import CPU, DISK
from ..engine.outcomes import FailureReason, LoadOutcome, TierState, WorkerReport
from .insight_feed import InsightFeed
from .responses import Responses
from .scheduler_state import SchedulerState

# A load that failed for these found the chunk's copy bad: only they forget and delete it.
# Any other reason (a timeout, a stalled copy, an I/O error) says nothing about its bytes.
FOUND_BAD = frozenset({FailureReason.MISSING, FailureReason.CORRUPT})


class WorkerFeedback:
    def __init__(self, state: SchedulerState, responses: Responses, insight: InsightFeed) -> None:
        self._s = state
        self._responses = responses
        self._insight = insight
        self.pending_writes = 0  # queued background writes on the busiest rank, as last reported
        self._partial: dict[str, LoadOutcome] = {}  # asynchronous loads some ranks reported

    def apply(self, report: WorkerReport) -> dict[str, int]:
        """Apply one report; returns, per failed load, the tokens vLLM recomputes."""
        s = self._s
        for tier, state in report.tier_states.items():
            if s.tier_states.get(tier) is TierState.SKIPPED and state is TierState.HEALTHY:
                s.unreadable.tier_recovered(tier)
            s.tier_states[tier] = state
        recomputed: dict[str, int] = {}
        failed: set[int] = set()
        for outcome in report.loads.values():
            failed.update(outcome.failed_block_ids)
        s.taint(failed, self._responses.late_trackers())
        if report.step is not None:
            s.loads_reported(report.step, failed)
        for rid, outcome in report.loads.items():
            if rid in s.async_loading:
                self._async_reported(rid, outcome, recomputed)
                continue
            self._measure(outcome)
            s.pins.release(rid)
            self._forget_failed_load(outcome)
            tracker = s.trackers.get(rid) or self._responses.late_tracker(rid)
            self._insight.loaded(outcome.tokens_by_tier())
            if tracker is not None:
                affected = tracker.record_load(outcome)
                self._responses.load_reported(rid)
                if affected:
                    recomputed[rid] = affected
        for failure in report.store_failures:
            s.forget(failure.tier, failure.name, failure.reason)
        s.deleted(report.deleted)
        for kept in report.kept:
            index = s.tiers.get(kept.tier)
            if index is not None:
                index.add_known(kept.name, kept.nbytes, most_recent=True)
        if report.pending_writes is not None:
            self.pending_writes = report.pending_writes
        return recomputed

    def _async_reported(self, rid: str, outcome: LoadOutcome, recomputed: dict[str, int]) -> None:
        """A rank finished an asynchronous load; once every rank has, it is settled like a load
        in the step, and kept for the request's first schedule (it has no tracker before)."""
        s = self._s
        partial = self._partial.pop(rid, None)
        if partial is not None:
            if partial.merge(outcome):
                outcome.rank_disagreements += 1  # counted with this report's outcome
            outcome = partial
        if outcome.ranks < s.facts.world_size:
            self._partial[rid] = outcome
            return
        s.async_loading.discard(rid)
        self._measure(outcome)
        s.pins.release(rid)
        promoted = s.async_promotions.pop(rid, ())
        s.promoting.difference_update(promoted)  # landed in the CPU tier (or dropped below)
        if outcome.cancelled:  # its promotions may not have landed: drop them on both sides
            for name in promoted:
                s.forget(CPU, name, FailureReason.MISSING)
        self._forget_failed_load(outcome)
        s.suspects.add(outcome.failed_block_ids)
        loaded = outcome.tokens_by_tier()
        self._insight.loaded(loaded)
        result = s.lookups.get(rid)
        planned = result.num_external_tokens if result is not None else 0
        tracker = s.trackers.get(rid)
        if tracker is not None:  # scheduled before every rank's report came (never, with vLLM)
            tracker.record_load(outcome)
        elif not outcome.cancelled:  # for the request's schedule (a failed load looks it up again)
            s.async_outcomes[rid] = (planned, outcome)
        if outcome.failed and not outcome.cancelled:
            recomputed[rid] = max(planned - sum(loaded.values()), 0)

    def _measure(self, outcome: LoadOutcome) -> None:
        """A load served by one tier tells how fast it loads (per rank: ranks load in parallel)."""
        tiers = {c.tier for c in outcome.chunks if c.tier is not None}
        if len(tiers) == 1 and not outcome.failed and not outcome.cancelled:
            ranks = max(self._s.facts.world_size, 1)
            self._s.tier_speeds.observe(tiers.pop(), outcome.nbytes / ranks, outcome.seconds)

    def _forget_failed_load(self, outcome: LoadOutcome) -> None:
        """A chunk found damaged or missing, and every later chunk of that prefix in the same
        tier, leave the index (and the tier). A chunk whose read was slow or failed for the
        tier's sake (a timeout, a stalled copy, an I/O error) is kept with the rest of its
        prefix: lookups only pass over it a while, so vLLM's next look-up does not load it again
        at once."""
        failed_tiers: set[str] = set()
        for chunk in outcome.chunks:
            if chunk.reason is FailureReason.PREFIX_FAILED:
                if chunk.planned_tier in failed_tiers:
                    self._s.forget(chunk.planned_tier, chunk.name, chunk.reason)
            elif chunk.reason in FOUND_BAD:
                failed_tiers.add(chunk.planned_tier)
                view = self._s.disk_view
                if chunk.reason is FailureReason.CORRUPT and chunk.planned_tier == DISK and view is not None:
                    view.load_found_damaged(chunk.name)  # before forgetting: its write time counts
                self._s.forget(chunk.planned_tier, chunk.name, chunk.reason)
            elif chunk.reason is not None and chunk.reason is not FailureReason.TIER_UNHEALTHY:
                self._s.unreadable.add(chunk.planned_tier, chunk.name)
