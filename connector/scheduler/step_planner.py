"""Builds one engine step's plan for the workers: loads, then evictions and stores in order.

Three rules keep what the tiers hold equal to what the scheduler's index says, and keep
wrong KV out of every tier:
- Writes are one ordered list. An admission that evicts a chunk stored earlier in the same
  plan cancels that store instead of deleting it first and writing it after; a request's own
  chunks of this step are held while it admits more, so a prompt larger than a tier keeps its
  first chunks (the ones a later prompt can reuse) rather than its last.
- A chunk computed over a block that loads in this same step names that block
  (``after_loads``): if the load fails, the worker withdraws the store.
- A chunk whose prefix holds a block whose load failed earlier and that no step has rewritten
  since (``SuspectBlocks``) is not stored until it has been.

Work per step is proportional to the step's new tokens and chunks, not to prompt lengths.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from ..engine.index import TierIndex
from ..engine.jobs import CPU, DISK, REMOTE, ChunkLoad, Eviction, LoadJob, StepPlan, StoreJob
from ..engine.keys import ChunkKey, key_fingerprint
from ..engine.policy import RequestPolicy, trace_headers
from ..engine.suspects import rewritten_blocks
from ..engine.tracker import LookupResult, RequestTracker, StorePolicy, cdiv, plan_chunk_loads
from .scheduler_state import SchedulerState

logger = logging.getLogger("vllm.kvlens")


class StepPlanner:
    def __init__(self, state: SchedulerState, policy: StorePolicy) -> None:
        self._s = state
        self.policy = policy
        self._bs = policy.block_size
        self._planned: dict[tuple[str, str], int] = {}  # (tier, chunk) -> its store's index in writes

    def plan(self, plan: StepPlan, out: Any, more_stores: Callable[[StepPlan], None] | None = None) -> None:
        """``more_stores``: admits stores of its own (blends) once the requests' are planned."""
        s = self._s
        self._planned = {}
        loaded: set[int] = set()  # blocks written by loads this step (or that should have been)
        step: list[tuple[RequestTracker, Any, int]] = []  # tracker, request, first token computed
        num_scheduled = out.num_scheduled_tokens
        for new in out.scheduled_new_reqs:
            tracker = self._start(new, num_scheduled.get(new.req_id, 0), plan, loaded)
            if tracker is not None:
                step.append((tracker, s.unfinished[new.req_id], new.num_computed_tokens))
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            tracker, request = s.trackers.get(rid), s.unfinished.get(rid)
            if tracker is None or request is None:
                continue
            new_blocks = cached.new_block_ids[i]
            num_computed, scheduled = cached.num_computed_tokens[i], num_scheduled.get(rid, 0)
            if rid in cached.resumed_req_ids:
                tracker.resume(
                    new_blocks[0] if new_blocks else [], num_computed, scheduled, request.num_tokens
                )
                self._plan_load(plan, tracker, s.lookups.pop(rid, None), loaded)
            else:
                if new_blocks:
                    tracker.block_ids.extend(new_blocks[0])
                tracker.advance(num_computed, scheduled, request.num_tokens)
            step.append((tracker, request, num_computed))
        if s.suspects:
            s.suspects.written(loaded.difference(plan.fail_blocks))
            for tracker, _request, start in step:
                s.suspects.written(rewritten_blocks(tracker.block_ids, start, tracker.computed, self._bs))
        s.taint(set(plan.fail_blocks))  # vLLM recomputes them; until then they are wrong
        if s.suspects:  # what a request computes in this step over a block still wrong is wrong
            for tracker, _request, _start in step:
                s.suspects.spread(tracker.block_ids, cdiv(tracker.computed, self._bs))
        s.loads_planned(plan.step, loaded)
        depends_on = loaded | s.unreported_loaded_blocks()
        for tracker, request, _start in step:
            self._plan_stores(plan, tracker, request, depends_on)
        if more_stores is not None:
            more_stores(plan)
        s.held_stores.failed(plan.step, plan.fail_blocks)  # failed on every rank from the start
        plan.writes = [w for w in plan.writes if w is not None]  # stores cancelled by later admissions

    # ---- trackers and loads ---------------------------------------------------------------
    def _start(self, new: Any, num_scheduled: int, plan: StepPlan, loaded: set[int]) -> RequestTracker | None:
        s = self._s
        rid = new.req_id
        request, policy = s.unfinished.get(rid), s.policies.get(rid)
        result = s.lookups.pop(rid, None)
        if request is None or policy is None:
            return None
        tracker = RequestTracker(
            request_id=rid,
            prompt_len=int(request.num_prompt_tokens),
            hasher=s.hashers.get(rid),
            block_ids=list(new.block_ids[0]) if new.block_ids else [],
            computed=min(new.num_computed_tokens + num_scheduled, request.num_tokens),
            saved_tokens=_saved_at_start(result, new.num_computed_tokens),
            save_skip_reason=policy.save_skip_reason,
            trace_context=trace_headers(request),
            vllm_cached_tokens=result.vllm_cached_tokens if result else 0,
            hit_tokens=result.hit_tokens if result else 0,
            miss_reason=result.miss_reason if result else None,
            miss_detail=result.miss_detail if result else None,
        )
        s.trackers[rid] = tracker
        self._plan_load(plan, tracker, result, loaded)
        return tracker

    def _plan_load(
        self, plan: StepPlan, tracker: RequestTracker, result: LookupResult | None, loaded: set[int]
    ) -> None:
        settled = self._s.async_outcomes.pop(tracker.request_id, None)
        if settled is not None:  # loaded outside the step before this schedule
            tracker.planned_load(settled[0])
            tracker.record_load(settled[1])
        if result is None:
            return
        tracker.hit_tokens = max(tracker.hit_tokens, result.hit_tokens)
        if result.async_planned:
            return
        job = self._load_job(
            plan, tracker.request_id, result, tracker.block_ids, tracker.trace_context, loaded
        )
        if job is not None:
            plan.loads.append(job)
            tracker.planned_load(result.num_external_tokens)

    def plan_async_load(
        self, request_id: str, result: LookupResult, block_ids: list[int], trace: Any
    ) -> LoadJob:
        """The load of a request that waits outside the batch (vLLM's asynchronous load),
        planned when vLLM allocates its blocks; promotions evict in the next plan."""
        self._planned = {}
        scratch = StepPlan()
        job = self._load_job(scratch, request_id, result, block_ids, trace, set())
        self._s.queue_evictions(scratch.evictions)
        chunks = job.chunks if job is not None else ()
        # The CPU tier receives a promoted chunk when the load finishes, steps from now: until
        # then the index must not evict it (its eviction would run before the copy lands).
        cpu = self._s.tiers.get(CPU)
        promoted = [c.name for c in chunks if CPU in c.promote_to]
        if cpu is not None and promoted:
            self._s.pins.add(request_id, ((cpu, name) for name in promoted))
            self._s.async_promotions[request_id] = promoted
            self._s.promoting.update(promoted)
        return LoadJob(request_id, chunks, trace, tuple(scratch.fail_blocks))

    def _load_job(
        self,
        plan: StepPlan,
        request_id: str,
        result: LookupResult,
        block_ids: list[int],
        trace: Any,
        loaded: set[int],
    ) -> LoadJob | None:
        """The chunks to load into ``block_ids`` (None: nothing to load); blocks vLLM allocated
        for tokens that cannot be loaded go to ``plan.fail_blocks``."""
        bs = self._bs
        if result.unloadable_tokens:
            end = result.load_end + result.unloadable_tokens
            self._fail_blocks(plan, block_ids[result.load_end // bs : cdiv(end, bs)], loaded)
        if not result.can_load:
            return None
        try:
            chunks = plan_chunk_loads(result.hits, block_ids, bs, result.vllm_cached_tokens, result.load_end)
        except ValueError as e:
            logger.error("KVLens: request %s: %s; its external tokens are reported failed", request_id, e)
            self._fail_blocks(plan, block_ids[result.vllm_cached_tokens // bs :], loaded)
            return None
        keys = {h.key.hex: h.key for h in result.hits}
        policy = self._s.policies.get(request_id)
        for i, chunk in enumerate(chunks):
            index = self._s.tiers.get(chunk.tier)
            if index is not None:
                index.touch(chunk.name)
            loaded.update(chunk.block_ids)
            if chunk.tier != CPU:
                chunks[i] = self._promote(plan, chunk, keys[chunk.name], request_id, policy)
                if chunks[i].promote_to:
                    self._s.tenants_hold(
                        chunks[i].promote_to, chunk.name, request_id, keys[chunk.name].num_tokens
                    )
        return LoadJob(request_id, tuple(chunks), trace)

    def _promote(
        self, plan: StepPlan, chunk: ChunkLoad, key: ChunkKey, request_id: str, policy: RequestPolicy | None
    ) -> ChunkLoad:
        """A chunk loaded from disk or the remote is kept in the CPU tier, if it has room (and
        routers hear of it as a store in ``cpu``)."""
        s = self._s
        cpu = s.tiers.get(CPU)
        if cpu is None or not s.usable(CPU) or chunk.name in cpu:
            return chunk
        retention, tenant = (policy.retention, policy.tenant) if policy is not None else (None, None)
        victims = cpu.admit(chunk.name, s.facts.chunk_nbytes(key.num_tokens), retention, tenant)
        if victims is None:
            return chunk
        self._evict(plan, cpu, victims)
        s.recently_evicted.discard(chunk.name)
        s.unreadable.discard(CPU, chunk.name)
        if s.block_events.enabled:
            s.block_events.promoted(chunk.name, key.start, key.num_tokens, s.unfinished.get(request_id), CPU)
        return dataclasses.replace(chunk, promote_to=(CPU,))

    def _evict(self, plan: StepPlan, tier: TierIndex, victims: list[str]) -> None:
        for victim in victims:
            if (tier.name, victim) in self._planned:
                self._cancel(plan, tier.name, victim)
            else:
                plan.writes.append(Eviction(tier.name, victim))
        self._s.recently_evicted.add(victims, tier.name)

    @staticmethod
    def _fail_blocks(plan: StepPlan, blocks: list[int], loaded: set[int]) -> None:
        plan.fail_blocks.extend(blocks)
        loaded.update(blocks)

    # ---- stores -------------------------------------------------------------------------
    def _plan_stores(self, plan: StepPlan, tracker: RequestTracker, request: Any, loaded: set[int]) -> None:
        """``loaded``: blocks whose loads are not known to have succeeded (this step's, and
        those of steps not reported yet)."""
        candidates = tracker.store_candidates(request.all_token_ids, self.policy)
        if not candidates:
            return
        bs = self._bs
        last_block = cdiv(candidates[-1].end, bs)
        suspect = self._s.suspects.first_in(tracker.block_ids, last_block)
        deps = [(i, b) for i, b in enumerate(tracker.block_ids[:last_block]) if b in loaded] if loaded else []
        held: list[tuple[TierIndex, str]] = []
        try:
            for key in candidates:
                end_block = cdiv(key.end, bs)
                blocks = tracker.blocks_of(key, bs)
                if blocks is None or (suspect is not None and suspect < end_block):
                    if blocks is None:
                        logger.error(
                            "KVLens: %s has fewer blocks than tokens; not storing", tracker.request_id
                        )
                    self._stop(tracker, key)
                    return
                tiers = self.admit(plan, key, held, self._s.policies.get(tracker.request_id))
                self._s.tenants_hold(tiers, key.hex, tracker.request_id, key.num_tokens)
                if CPU in tiers and key.num_tokens < self.policy.chunk_size and self._s.tails is not None:
                    self._s.tails.add(tracker.hasher.parent_at(key.start), key.num_tokens, key.hex)
                if tiers and self._s.block_events.enabled:
                    self._s.block_events.describe(key.hex, key.start, key.num_tokens, request)
                if tiers:
                    self._planned.update({(t, key.hex): len(plan.writes) for t in tiers})
                    after = tuple(b for i, b in deps if i < end_block)
                    plan.writes.append(
                        StoreJob(
                            tracker.request_id,
                            key.hex,
                            blocks,
                            tuple(tiers),
                            key.num_tokens,
                            after,
                            tracker.trace_context,
                            key_fingerprint(tracker.hasher.namespace),
                            self._settled_by(plan.step, key.hex, tiers, after),
                        )
                    )
                    tracker.stored_chunks += 1
                tracker.saved_tokens = key.end
        finally:
            for tier, name in held:
                tier.unpin(name)

    def _settled_by(self, step: int, name: str, tiers: list[str], after: tuple[int, ...]) -> int:
        """Tensor parallelism: a store over loads not reported yet is held on every rank until
        the report of the last of them (``engine/held_stores.py``); -1: written at once."""
        s = self._s
        steps = s.steps_loading(set(after)) if after and s.facts.world_size > 1 else []
        return s.held_stores.hold(step, name, tiers, after, steps) if steps else -1

    def _stop(self, tracker: RequestTracker, key: ChunkKey) -> None:
        """Stores stop before ``key``; they are planned again in a later step."""
        size = self.policy.chunk_size
        if key.start >= tracker.prompt_len - tracker.prompt_len % size:
            tracker.tails_done = False

    def admit(
        self,
        plan: StepPlan,
        key: ChunkKey,
        held: list[tuple[TierIndex, str]],
        policy: RequestPolicy | None,
        nbytes: int | None = None,
    ) -> list[str]:
        """Admit the chunk (``nbytes`` per rank; default: a prefix chunk's) to every usable tier
        that can take it; the tiers to write."""
        s = self._s
        nbytes = s.facts.chunk_nbytes(key.num_tokens) if nbytes is None else nbytes
        retention, tenant = (policy.retention, policy.tenant) if policy is not None else (None, None)
        written: list[str] = []
        for tier in s.tiers.values():
            if not s.usable(tier.name):
                continue
            if key.hex in tier:
                tier.touch(key.hex)
                tier.retain(key.hex, retention)
                continue
            victims = tier.admit(key.hex, nbytes, retention, tenant)
            if victims is None:
                continue  # everything left in this tier is pinned or held
            self._evict(plan, tier, victims)
            s.recently_evicted.discard(key.hex)
            if tier.name == DISK and s.disk_view is not None:
                s.disk_view.note_changed([*victims, key.hex])
            tier.pin(key.hex)
            held.append((tier, key.hex))
            written.append(tier.name)
        if s.stores_remote:  # no index: Redis holds what it holds. Named even while it is skipped:
            written.append(REMOTE)  # the worker counts it (tier_unhealthy) or writes it if back
        for name in written:  # a fresh copy replaces one whose load failed
            s.unreadable.discard(name, key.hex)
        return written

    def _cancel(self, plan: StepPlan, tier: str, name: str) -> None:
        """A store of this plan lost its place in ``tier`` before it ran: don't write it there."""
        at = self._planned.pop((tier, name))
        job = plan.writes[at]
        assert isinstance(job, StoreJob)
        remaining = tuple(t for t in job.tiers if t != tier)
        plan.writes[at] = dataclasses.replace(job, tiers=remaining) if remaining else None  # type: ignore[call-overload]


def _saved_at_start(result: LookupResult | None, num_computed: int) -> int:
    """Chunks ending at or before this are stored: what the lookup found, but not beyond what an
    asynchronous load, failed in part, left valid (vLLM recomputes the rest; stored again)."""
    if result is None:
        return 0
    if result.async_planned:
        return min(result.hit_tokens, num_computed)
    return result.hit_tokens
