"""The scheduler half: composes the lookup, the step planner, the workers' feedback, the
responses and the insight feed around one shared state, and answers the facade's calls.

It owns the index of every tier. Lookups answer from memory (no disk or network round trip
per chunk); stores and evictions are decided here (``step_planner.py``) and carried out by
the workers in the order issued, so what a lookup finds is what the load finds. Workers
report failed loads and stores; chunks found damaged or missing, and every later chunk of
their prefix, leave the index at once and are deleted from their tier, so damage costs one
recompute and the recompute stores good copies (a slow read deletes nothing).

vLLM's ``Request`` and ``SchedulerOutput`` are used duck-typed, so this package's scheduler
modules do not import vLLM and are tested with plain stand-ins.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ..config.loading import KVLensConfig
from ..engine.facts import EngineFacts
from ..engine.jobs import DISK, REMOTE, StepPlan
from ..engine.outcomes import LookupOutcome, RequestSummary, TierState, WorkerReport
from ..engine.policy import trace_headers
from ..engine.snapshots import InsightSnapshot, SchedulerSizes, TierGauge, TierRetention
from ..engine.tenants import DEFAULT, TenantUsage, tenant_id, use_deployment_key
from ..engine.tracker import StorePolicy
from .admin import CacheAdmin
from .blend_scheduler import SchedulerBlend
from .insight_feed import InsightFeed
from .prefix_lookup import PrefixLookup
from .responses import FinishResult, Responses
from .scheduler_state import SchedulerState
from .step_planner import StepPlanner
from .tenant_id_key import deployment_key
from .worker_feedback import WorkerFeedback

MAX_DRAIN_S = 30.0  # an idle engine keeps stepping at most this long for background writes

__all__ = ["ConnectorScheduler", "FinishResult"]


class ConnectorScheduler:
    def __init__(
        self,
        config: KVLensConfig,
        facts: EngineFacts,
        clock: Callable[[], float] = time.monotonic,
        blend_separators: Sequence[Sequence[int]] = (),
    ) -> None:
        """``blend_separators``: the separator's token ids (``enable_blending``; see ``vllm_compat``)."""
        use_deployment_key(deployment_key(config))  # tenant ids: the deployment's, before any request
        self.state = state = SchedulerState(config, facts, clock)
        self.config, self.facts, self._clock = config, facts, clock
        # The shared tables, by their names (tests and tools read them).
        self.tiers, self.pins, self.suspects = state.tiers, state.pins, state.suspects
        self.lookups, self.trackers, self.unfinished = state.lookups, state.trackers, state.unfinished
        self.tier_states, self.recently_evicted = state.tier_states, state.recently_evicted
        self.tails, self.block_events, self.remote = state.tails, state.block_events, state.remote
        self.prefix = PrefixLookup(state)
        self.insight = InsightFeed(state)
        self.prefix.compute_cost = lambda: self.insight.prefill_cost.seconds_per_token
        self.responses = Responses(state, self.prefix)
        self.feedback = WorkerFeedback(state, self.responses, self.insight)
        self.planner = StepPlanner(
            state,
            StorePolicy(
                config.chunk_size,
                facts.block_size,
                config.saves_partial_chunks,
                config.extra_config.block_granular_tails and not config.discard_partial_chunks,
                config.save_decode_cache,
            ),
        )
        self.blend: SchedulerBlend | None = None
        if config.enable_blending and blend_separators:
            self.blend = SchedulerBlend(
                config.blend, blend_separators, config.chunk_size, state, self.planner
            )
        self.whatif, self.info = self.insight.whatif, self.insight.info
        self.admin = CacheAdmin(state, clock)  # kvlens clear through a running engine; namespace records
        self._step = 0
        self._draining_since: float | None = None
        self._evictions_seen: dict[str, int] = {}

    # ---- lookup -------------------------------------------------------------------------
    def usable(self, tier: str) -> bool:
        return self.state.usable(tier)

    def lookup(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens KVLens will load beyond vLLM's hit (side-effect free but for pins); None while
        the remote tier's answer is awaited (vLLM asks again at its next step)."""
        self.state.forget_scrubbed()  # damage found since the last step is not offered
        need = self.prefix.lookup(request, num_computed_tokens)
        policy = self.state.policies.get(request.request_id)
        self.state.tenants.open(request.request_id, policy.namespace if policy is not None else None)
        if self.blend is not None and need is not None:
            blended = self.blend.lookup(request, num_computed_tokens, need)
            if blended is not None:
                return blended
        return need

    def blends(self, request_id: str) -> bool:
        """The request's external tokens are a blend's (allocated or running)."""
        return self.blend is not None and (request_id in self.blend.ready or request_id in self.blend.running)

    def loads_async(self, request_id: str) -> bool:
        """The lookup's tokens load outside the step (the request waits outside the batch)."""
        result = self.lookups.get(request_id)
        return result is not None and result.load_async

    def after_alloc(
        self, request: Any, num_external_tokens: int, block_ids: list[int] | None = None
    ) -> LookupOutcome | None:
        """vLLM allocated blocks: the lookup is final. Its outcome, for telemetry."""
        if self.blend is not None and self.blend.after_alloc(request, num_external_tokens, block_ids):
            num_external_tokens, block_ids = 0, None  # the blend's tokens: the prefix path loads none
        result = self.prefix.after_alloc(request, num_external_tokens)
        if result is None:
            return None
        if result.load_async and result.can_load:  # the request waits while the workers load
            rid = request.request_id
            job = self.planner.plan_async_load(rid, result, list(block_ids or ()), trace_headers(request))
            self.state.async_jobs.append(job)
            self.state.async_loading.add(rid)
            result.async_planned = True
        if request.request_id not in self.trackers:  # first schedule (a resumed one is not counted again)
            self.insight.note_references(request, result)
        return self._count_tenant(self.prefix.outcome(request, result, scheduled=True))

    def _count_tenant(self, outcome: LookupOutcome | None) -> LookupOutcome | None:
        """A final lookup counts for its tenant as it does in lookup_tokens (a resumed one not)."""
        if outcome is not None and not outcome.resumed:
            self.state.tenants.looked_up(outcome.request_id, outcome.prompt_tokens, outcome.hit_tokens)
        return outcome

    def lookup_outcome(self, request: Any, result: Any, scheduled: bool) -> LookupOutcome:
        return self.prefix.outcome(request, result, scheduled)

    def external_tokens_by_tier(self, request_id: str, num_external_tokens: int) -> dict[str, int]:
        return self.prefix.external_tokens_by_tier(request_id, num_external_tokens)

    # ---- per-step plan ------------------------------------------------------------------
    def build_plan(self, scheduler_output: Any) -> StepPlan:
        self.state.merge_disk_scan()
        self._step += 1
        state = self.state
        plan = StepPlan(
            writes=state.take_pending_evictions(),
            async_loads=state.async_jobs,
            cancel_async=state.async_cancels,
            step=self._step,
            reported_through=state.reported_through,
            withdrawn=state.held_stores.take_withdrawn(),
        )
        state.async_jobs, state.async_cancels = [], []
        self.planner.plan(plan, scheduler_output, self._plan_blends if self.blend is not None else None)
        self.admin.step(plan)
        self.block_events.planned(plan)
        plan.drain = not self.unfinished and self.has_pending_work()
        plan.idle = not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        if not self.unfinished:  # an empty step of an idle engine
            self.insight.catch_up()
        self.insight.measure_step(scheduler_output, sum(c.num_tokens for j in plan.loads for c in j.chunks))
        return plan

    def _plan_blends(self, plan: StepPlan) -> None:
        assert self.blend is not None
        plan.blends = self.blend.plan(plan)

    # ---- feedback -----------------------------------------------------------------------
    def on_worker_report(self, report: WorkerReport) -> dict[str, int]:
        """Apply what the workers did; returns, per failed load, the tokens vLLM recomputes."""
        for rid, outcome in report.loads.items():
            self.state.tenants.loaded(rid, sum(outcome.tokens_by_tier().values()))
        if self.blend is not None and report.blends:
            self.blend.reported(report.blends)
        return self.feedback.apply(report)

    def step_done(self) -> None:
        """A step's output reached the scheduler (with or without a worker report)."""
        self.responses.step_done()
        if self.blend is not None:
            self.blend.step_done()

    # ---- finish, reset, shutdown --------------------------------------------------------
    def finish(self, request: Any) -> FinishResult:
        policy = self.state.policies.get(request.request_id)
        if getattr(getattr(request, "status", None), "name", "") != "FINISHED_ABORTED":
            self.insight.finished(request.request_id)  # ended by its last step, not a client
        result = self.responses.finish(request)
        self._count_tenant(result.unscheduled_lookup)
        if self.blend is not None:
            self.blend.finish(request.request_id, result.params)
        tenant = tenant_id(policy.namespace if policy is not None else None)
        if result.params is not None and "kvlens" in result.params and tenant != DEFAULT:
            result.params["kvlens"]["tenant"] = tenant  # the id its per-tenant series carry
        return result

    def take_done(self) -> list[RequestSummary]:
        done = self.responses.take_done()
        if self.blend is not None:
            done = self.blend.with_details(done)
        for summary in done:  # its load is reported: its tenant is no longer needed
            self.state.tenants.close(summary.request_id)
        return done

    def take_tenant_usage(self) -> TenantUsage:
        """Per-tenant lookups, hits and loads since the last call, and the bytes held now."""
        return self.state.tenants.take()

    def take_saved_seconds(self) -> dict[str, float]:
        """Estimated prefill seconds saved per tier since the last call."""
        return self.insight.take_saved_seconds()

    def has_pending_work(self) -> bool:
        """Background writes still queued: keep the engine stepping (bounded) until they land.
        Evictions decided since the last plan (a report dropped a chunk): one more step."""
        if self.admin.has_work() or self.state.has_pending_evictions():
            return True
        view = self.state.disk_view
        if view is not None and view.scrub is not None and view.scrub.busy:
            return True  # damage found: forget it (and delete every rank's copy) without waiting
        pending = self.feedback.pending_writes
        if pending <= 0 or self.unfinished:
            self._draining_since = None
            return pending > 0
        now = self._clock()
        if self._draining_since is None:
            self._draining_since = now
        return now - self._draining_since < MAX_DRAIN_S

    def take_evictions(self) -> dict[str, int]:
        """Chunks each tier evicted to make room since the last call (the disk tier: those whose
        file this engine's delete removed, so engines sharing a directory count each once)."""
        out = {}
        for name, tier in self.tiers.items():
            count = self.state.disk_evictions if name == DISK else tier.evictions
            seen = self._evictions_seen.get(name, 0)
            if count != seen:
                out[name] = max(count - seen, 0)
                self._evictions_seen[name] = count
        return out

    def reset(self) -> bool:
        """Forget every unpinned chunk (vLLM's reset_prefix_cache with reset_connector)."""
        self.state.reset()
        return True

    def shutdown(self) -> None:
        self.admin.shutdown()
        self.insight.shutdown()
        self.state.shutdown()

    def sizes(self) -> SchedulerSizes:
        """Internal sizes, for leak-spotting gauges (and the disk scrub's totals)."""
        scrub = self.state.disk_view.scrub if self.state.disk_view is not None else None
        return SchedulerSizes(
            request_trackers=len(self.trackers),
            load_specs=len(self.lookups),
            unfinished_requests=len(self.unfinished),
            pinned_requests=len(self.pins),
            pending_saves=sum(
                1 for t in self.trackers.values() if t.save_skip_reason is None and not t.prefill_done
            ),
            suspect_blocks=len(self.suspects),
            pending_writes=self.feedback.pending_writes,
            tiers=tuple(self._tier_gauge(name) for name in self.tier_states),
            disk_scrubbed_records=scrub.scrubbed_records if scrub is not None else 0,
            disk_scrub_damaged=scrub.damaged_found if scrub is not None else 0,
            retention=tuple(
                TierRetention(
                    name,
                    index.bytes_by_class(),
                    index.retained_evictions,
                    index.retention.demotions,
                    index.quota_evictions,
                    index.quota_refusals,
                )
                for name, index in self.tiers.items()
            ),
        )

    def _tier_gauge(self, name: str) -> TierGauge:
        state = self.tier_states[name]
        if name == REMOTE and self.remote is not None and not self.remote.health.usable():
            state = TierState.SKIPPED  # lookups cannot reach it
        index = self.tiers.get(name)
        if index is None:
            return TierGauge(name, state)
        return TierGauge(
            name,
            state,
            len(index),
            index.used_bytes,
            index.capacity_bytes,
            index.pinned_keys,
            index.pinned_bytes,
            self.state.shared_storage.get(name, ""),
        )

    def insight_snapshot(self) -> InsightSnapshot:
        """The what-if curves, the measured prefill cost and the instance's identity (the
        curves exact whenever nothing runs)."""
        return self.insight.snapshot(idle=not self.unfinished)

    def insight_behind(self) -> bool:
        """Idle with what-if references not yet fed or published: worth an empty step."""
        return not self.unfinished and self.insight.behind()
