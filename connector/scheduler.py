"""The scheduler half: lookups, pins, request trackers and the per-step plan for workers.

It owns the index of every tier. Lookups answer from memory (no disk or network round
trip per chunk); stores and evictions are decided here and carried out by the workers in
the order issued, so what a lookup finds is what the load finds. Workers report back
failed loads and stores, which leave the index at once.

vLLM's ``Request`` and ``SchedulerOutput`` are used duck-typed, so this module does not
import vLLM and is tested with plain stand-ins.
"""

from __future__ import annotations

import logging
from typing import Any

from .config import ConfigError, KVLensConfig
from .disk_sync import DiskWatcher, SharedDiskView
from .engine.facts import EngineFacts
from .engine.index import PinTable, TierIndex
from .engine.jobs import CPU, DISK, Eviction, LoadJob, StepPlan, StoreJob, WorkerReport
from .engine.keys import PrefixHasher, block_aligned_keys
from .engine.requests import (
    BELOW_MIN_RETRIEVE,
    PRODUCER_ROLE,
    RecentlyEvicted,
    RequestPolicy,
    decide_policy,
    miss_reason,
)
from .engine.tracker import (
    ChunkHit,
    LookupResult,
    RequestTracker,
    external_tokens,
    plan_chunk_loads,
    tokens_by_tier,
)

logger = logging.getLogger("vllm.kvlens")


class ConnectorScheduler:
    def __init__(self, config: KVLensConfig, facts: EngineFacts) -> None:
        config.check_block_size(facts.block_size)
        self.config = config
        self.facts = facts
        self.tiers: dict[str, TierIndex] = {}
        if config.local_cpu:
            self.tiers[CPU] = TierIndex(CPU, config.cpu_budget_bytes)
        self._disk_view: SharedDiskView | None = None
        if config.local_disk:
            self.tiers[DISK] = TierIndex(DISK, config.disk_budget_bytes)
            watcher = DiskWatcher(
                config.local_disk, facts.world_size, config.extra_config.disk_scan_interval_s
            )
            self._disk_view = SharedDiskView(self.tiers[DISK], watcher)
        smallest = min(t.capacity_bytes for t in self.tiers.values())
        if facts.stores and facts.chunk_nbytes(config.chunk_size) > smallest:
            cpu = self.tiers.get(CPU)
            key = "max_local_cpu_size" if cpu and cpu.capacity_bytes == smallest else "max_local_disk_size"
            raise ConfigError(
                f"KVLens config key '{key}' holds no chunk: one chunk of {config.chunk_size} tokens "
                f"is {facts.chunk_nbytes(config.chunk_size)} bytes"
            )
        self._base_namespace = facts.namespace()
        self.pins = PinTable()
        self.policies: dict[str, RequestPolicy] = {}
        self.hashers: dict[str, PrefixHasher] = {}
        self.lookups: dict[str, LookupResult] = {}
        self.trackers: dict[str, RequestTracker] = {}
        self.unfinished: dict[str, Any] = {}  # request id -> vLLM Request
        self.recently_evicted = RecentlyEvicted()
        self._pending_evictions: list[Eviction] = []

    # ---- lookup -------------------------------------------------------------------------
    def _policy(self, request: Any) -> RequestPolicy:
        rid = request.request_id
        policy = self.policies.get(rid)
        if policy is None:
            lora = getattr(request, "lora_request", None)
            policy = decide_policy(
                self._base_namespace,
                rid,
                getattr(request, "kv_transfer_params", None),
                getattr(lora, "lora_name", None) if lora is not None else None,
                getattr(request, "cache_salt", None),
                getattr(request, "priority", 0) or 0,
                bool(getattr(request, "mm_features", None))
                or getattr(request, "prompt_embeds", None) is not None
                or rid.startswith("mock_req"),  # data-parallel padding requests
                self.facts.kv_role,
                self.config.priority_limit,
                self.config.force_skip_save,
            )
            self.policies[rid] = policy
            if policy.namespace is not None:
                self.hashers[rid] = PrefixHasher(policy.namespace, self.config.chunk_size)
        return policy

    def lookup(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens KVLens will load beyond vLLM's hit (side-effect free but for pins)."""
        self._merge_disk_scan()
        rid = request.request_id
        policy = self._policy(request)
        tokens = request.all_token_ids
        if self.config.skip_last_n_tokens:
            tokens = tokens[: max(len(tokens) - self.config.skip_last_n_tokens, 0)]
        if policy.namespace is None or not self.facts.loads:
            reason = policy.skip_reason or PRODUCER_ROLE
            self.lookups[rid] = LookupResult([], 0, num_computed_tokens, 0, reason)
            return 0
        keys = self.hashers[rid].keys(tokens, include_partial=True)
        hits: list[ChunkHit] = []
        first_missing: str | None = None
        for key in keys:
            tier = self._tier_holding(key.hex)
            if tier is None:
                partial = key.num_tokens < self.config.chunk_size
                first_missing = None if partial else key.hex
                break
            hits.append(ChunkHit(key, tier.name))
        if self.config.extra_config.block_granular_tails:
            self._extend_by_blocks(rid, tokens, hits)
        hit_tokens = hits[-1].key.end if hits else 0
        need = external_tokens(hit_tokens, num_computed_tokens, request.num_tokens)
        reason = miss_reason(
            len(tokens),
            hit_tokens,
            num_computed_tokens,
            first_missing,
            self.recently_evicted,
        )
        if 0 < need < self.config.min_retrieve_tokens:
            need, reason = 0, BELOW_MIN_RETRIEVE
        self.lookups[rid] = LookupResult(hits, hit_tokens, num_computed_tokens, need, reason)
        if need:
            self.pins.pin(rid, ((self.tiers[h.tier], h.key.hex) for h in hits))
        else:
            self.pins.release(rid)
        return need

    def _tier_holding(self, name: str) -> TierIndex | None:
        """The fastest tier that holds the chunk."""
        return next((t for t in self.tiers.values() if name in t), None)

    def _extend_by_blocks(self, rid: str, tokens: Any, hits: list[ChunkHit]) -> None:
        """After the last whole-chunk hit, take the longest stored whole-block prefix of the next chunk."""
        last = hits[-1].key if hits else None
        if last is not None and last.num_tokens < self.config.chunk_size:
            return  # the hit already ends in an unfull chunk
        start = last.end if last is not None else 0
        parent = self.hashers[rid].parent_of(last)
        for key in block_aligned_keys(parent, tokens, start, self.config.chunk_size, self.facts.block_size):
            tier = self._tier_holding(key.hex)
            if tier is not None:
                hits.append(ChunkHit(key, tier.name))
                return

    def after_alloc(self, request: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        self.unfinished[rid] = request
        result = self.lookups.get(rid)
        if result is None:
            return
        if num_external_tokens > result.num_external_tokens:
            logger.error(
                "KVLens: vLLM allocated %d external tokens for %s but only %d can be loaded",
                num_external_tokens,
                rid,
                result.num_external_tokens,
            )
        result.num_external_tokens = min(num_external_tokens, result.num_external_tokens)
        result.can_load = result.num_external_tokens > 0
        if not result.can_load:
            self.pins.release(rid)

    def external_tokens_by_tier(self, request_id: str, num_external_tokens: int) -> dict[str, int]:
        """How the tokens about to be loaded split across tiers (for vLLM's hit-source metric)."""
        result = self.lookups.get(request_id)
        if result is None or num_external_tokens <= 0:
            return {}
        start = result.vllm_cached_tokens
        return tokens_by_tier(result.hits, start, start + num_external_tokens)

    # ---- per-step plan ------------------------------------------------------------------
    def build_plan(self, scheduler_output: Any) -> StepPlan:
        self._merge_disk_scan()
        plan = StepPlan(evictions=self._pending_evictions)
        self._pending_evictions = []
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self._plan_new(plan, new, num_scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            tracker = self.trackers.get(rid)
            request = self.unfinished.get(rid)
            if tracker is None or request is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                result = self.lookups.pop(rid, None)
                tracker.resume(
                    request.all_token_ids,
                    new_blocks[0] if new_blocks else [],
                    cached.num_computed_tokens[i],
                    num_scheduled.get(rid, 0),
                    result.hit_tokens if result else 0,
                )
                self._plan_load(plan, tracker, result)
            else:
                if new_blocks:
                    tracker.block_ids.extend(new_blocks[0])
                tracker.advance(
                    request.all_token_ids, cached.num_computed_tokens[i], num_scheduled.get(rid, 0)
                )
            self._plan_stores(plan, tracker)
        return plan

    def _plan_new(self, plan: StepPlan, new: Any, num_scheduled: int) -> None:
        rid = new.req_id
        policy = self.policies.get(rid)
        result = self.lookups.pop(rid, None)
        if policy is None or policy.namespace is None or new.prompt_token_ids is None:
            return
        hit = result.hit_tokens if result else 0
        tracker = RequestTracker(
            request_id=rid,
            prompt_len=len(new.prompt_token_ids),
            hasher=self.hashers[rid],
            tokens=list(new.prompt_token_ids[: new.num_computed_tokens + num_scheduled]),
            block_ids=list(new.block_ids[0]) if new.block_ids else [],
            saved_tokens=hit,
            hit_tokens=hit,
            save_skip_reason=policy.save_skip_reason if self.facts.stores else "producer_off",
            miss_reason=result.miss_reason if result else None,
        )
        self.trackers[rid] = tracker
        self._plan_load(plan, tracker, result)
        self._plan_stores(plan, tracker)

    def _plan_load(self, plan: StepPlan, tracker: RequestTracker, result: LookupResult | None) -> None:
        if result is None or not result.can_load:
            return
        chunks = plan_chunk_loads(
            result.hits,
            tracker.block_ids,
            self.facts.block_size,
            result.vllm_cached_tokens,
            result.load_end,
        )
        for chunk in chunks:
            self.tiers[chunk.tier].touch(chunk.name)
        plan.loads.append(LoadJob(tracker.request_id, tuple(chunks)))
        tracker.loaded_tokens = result.num_external_tokens

    def _plan_stores(self, plan: StepPlan, tracker: RequestTracker) -> None:
        candidates = tracker.store_candidates(
            self.config.chunk_size,
            self.config.saves_partial_chunks,
            self.config.save_decode_cache,
            self.facts.block_size if self.config.extra_config.block_granular_tails else 0,
        )
        for key in candidates:
            blocks = tracker.blocks_of(key, self.facts.block_size)
            if blocks is None:
                logger.error("KVLens: %s has fewer blocks than tokens; not storing", tracker.request_id)
                return
            nbytes = self.facts.chunk_nbytes(key.num_tokens)
            written: list[str] = []
            for tier in self.tiers.values():
                if key.hex in tier:
                    tier.touch(key.hex)
                    continue
                victims = tier.admit(key.hex, nbytes)
                if victims is None:
                    continue  # everything left in this tier is pinned
                self._evict(plan, tier.name, victims)
                written.append(tier.name)
                if tier.name == DISK and self._disk_view is not None:
                    self._disk_view.note_changed([key.hex])
                self.recently_evicted.discard(key.hex)
            if written:
                plan.stores.append(
                    StoreJob(tracker.request_id, key.hex, blocks, tuple(written), key.num_tokens)
                )
                tracker.stored_chunks += 1
            tracker.saved_tokens = key.end

    def _evict(self, plan: StepPlan, tier: str, names: list[str]) -> None:
        if not names:
            return
        plan.evictions.extend(Eviction(tier, n) for n in names)
        self.recently_evicted.add(names)
        if tier == DISK and self._disk_view is not None:
            self._disk_view.note_changed(names)

    def _merge_disk_scan(self) -> None:
        if self._disk_view is not None:
            self._evict_later(DISK, self._disk_view.merge())

    # ---- feedback and finish ------------------------------------------------------------
    def on_worker_report(self, report: WorkerReport) -> None:
        for rid, outcome in report.loads.items():
            self.pins.release(rid)
            for name, tier, reason in outcome.failed_chunks:
                self._forget(tier, name, reason)
            tracker = self.trackers.get(rid)
            if tracker is not None and outcome.failed_block_ids:
                tracker.failed_blocks += len(outcome.failed_block_ids)
        for name, tier, reason in report.store_failures:
            self._forget(tier, name, reason)

    def _forget(self, tier: str, name: str, reason: str) -> None:
        index = self.tiers.get(tier)
        if index is not None and index.remove(name):
            logger.warning("KVLens: dropped chunk %s from %s tier: %s", name[:12], tier, reason)

    def finish(self, request: Any) -> dict[str, Any] | None:
        rid = request.request_id
        self.pins.release(rid)
        self.unfinished.pop(rid, None)
        self.policies.pop(rid, None)
        self.hashers.pop(rid, None)
        result = self.lookups.pop(rid, None)
        tracker = self.trackers.pop(rid, None)
        hit = tracker.hit_tokens if tracker else (result.hit_tokens if result else 0)
        if not self.config.extra_config.enable_cache_usage_details_in_response:
            return None
        return {"num_lmcache_cached_tokens": hit}

    def reset(self) -> bool:
        """Forget every unpinned chunk (vLLM's reset_prefix_cache with reset_connector)."""
        for tier in self.tiers.values():
            names = tier.clear()
            self._evict_later(tier.name, names)
        return True

    def _evict_later(self, tier: str, names: list[str]) -> None:
        self._pending_evictions.extend(Eviction(tier, n) for n in names)
        self.recently_evicted.add(names)

    def shutdown(self) -> None:
        if self._disk_view is not None:
            self._disk_view.stop()

    def sizes(self) -> dict[str, int]:
        """Internal sizes, for leak-spotting gauges."""
        out = {
            "request_trackers": len(self.trackers),
            "load_specs": len(self.lookups),
            "unfinished_requests": len(self.unfinished),
            "pinned_requests": len(self.pins),
        }
        for name, tier in self.tiers.items():
            out[f"{name}_chunks"] = len(tier)
            out[f"{name}_used_bytes"] = tier.used_bytes
            out[f"{name}_pinned_chunks"] = tier.pinned_keys
            out[f"{name}_pinned_bytes"] = tier.pinned_bytes
        return out
