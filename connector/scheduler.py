"""The scheduler half: lookups, pins, request trackers, and feedback from the workers.

It owns the index of every tier. Lookups answer from memory (no disk or network round trip
per chunk); stores and evictions are decided here (``step_planner.py``) and carried out by
the workers in the order issued, so what a lookup finds is what the load finds. Workers
report failed loads and stores; those chunks, and every later chunk of a prefix whose load
failed, leave the index at once and are deleted from their tier, so damage costs one
recompute and the recompute stores good copies.

vLLM's ``Request`` and ``SchedulerOutput`` are used duck-typed, so this module does not
import vLLM and is tested with plain stand-ins.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .config import ConfigError, KVLensConfig
from .disk_sync import DiskWatcher, SharedDiskView
from .engine.block_events import BlockEvents
from .engine.facts import EngineFacts
from .engine.index import PinTable, TierIndex
from .engine.jobs import CPU, DISK, REMOTE, Eviction, StepPlan
from .engine.keys import ChunkKey, PrefixHasher, block_aligned_keys, block_prefixes
from .engine.namespaces import FirstChunkNamespaces, namespace_differences
from .engine.outcomes import (
    FailureReason,
    LoadOutcome,
    LookupOutcome,
    MissReason,
    RemoteCall,
    RequestSummary,
    TierState,
    WorkerReport,
)
from .engine.policy import RecentlyEvicted, RequestPolicy, decide_policy, miss_reason, trace_headers
from .engine.prefill_cost import PrefillCostMeter
from .engine.suspects import SuspectBlocks
from .engine.tails import TailDirectory
from .engine.tracker import (
    ChunkHit,
    LookupResult,
    RequestTracker,
    StorePolicy,
    external_tokens,
    tokens_by_tier,
)
from .engine.whatif import WhatIfTracker
from .instance_info import instance_info
from .remote_lookup import RemoteLookup
from .step_planner import StepPlanner
from .tiers.disk import DiskTier
from .tiers.redis_tier import RedisTier

logger = logging.getLogger("vllm.kvlens")

MAX_DRAIN_S = 30.0  # an idle engine keeps stepping at most this long for background writes
WHATIF_GAUGE_S = 1.0  # the what-if curves are read at most this often


@dataclass(frozen=True, slots=True)
class FinishResult:
    params: dict[str, Any] | None  # the response's kv_transfer_params
    unscheduled_lookup: LookupOutcome | None  # a lookup that never reached a schedule


class ConnectorScheduler:
    def __init__(
        self, config: KVLensConfig, facts: EngineFacts, clock: Callable[[], float] = time.monotonic
    ) -> None:
        config.check_block_size(facts.block_size)
        self.config = config
        self.facts = facts
        self._clock = clock
        self.tiers: dict[str, TierIndex] = {}
        # Exact only while no other engine's chunks can reach the index (see tails.py).
        only_cpu = config.local_cpu and not config.local_disk and not config.remote_url
        self.tails = TailDirectory() if only_cpu else None
        if config.local_cpu:
            on_drop = self.tails.discard if self.tails is not None else None
            self.tiers[CPU] = TierIndex(CPU, config.cpu_budget_bytes, on_drop)
        self.disk_view: SharedDiskView | None = None
        if config.local_disk:
            self.tiers[DISK] = TierIndex(DISK, config.disk_budget_bytes)
            extra = config.extra_config
            disk = DiskTier(config.local_disk, facts.kv_layout, extra.disk_shared_grace_s)
            watcher = DiskWatcher(disk, facts.world_size, extra.disk_scan_interval_s)
            self.disk_view = SharedDiskView(
                self.tiers[DISK], watcher, facts.stores, extra.disk_shared_grace_s
            )
        self._check_budgets()
        self.remote: RemoteLookup | None = None
        if config.remote is not None and facts.loads:
            extra = config.extra_config
            timeout = extra.remote_lookup_timeout_ms / 1000
            client = RedisTier(
                config.remote, facts.kv_layout, extra.remote_key_prefix, None, timeout, timeout
            )
            self.remote = RemoteLookup(client, facts.world_size, clock)
        self.tier_states: dict[str, TierState] = {name: TierState.HEALTHY for name in config.tier_names()}
        self.stores_remote = config.remote is not None and facts.stores
        self._base_namespace = facts.namespace()
        self.pins = PinTable()
        self.policies: dict[str, RequestPolicy] = {}
        self.hashers: dict[str, PrefixHasher] = {}
        self.lookups: dict[str, LookupResult] = {}
        self.trackers: dict[str, RequestTracker] = {}
        self.unfinished: dict[str, Any] = {}  # request id -> vLLM Request
        self.recently_evicted = RecentlyEvicted()
        self.suspects = SuspectBlocks()
        self._pending_evictions: list[Eviction] = []
        # Finished in this step before their load was reported: the response is filled in late.
        self._late: dict[str, tuple[RequestTracker, dict[str, Any] | None]] = {}
        self._pending_writes = 0
        self._draining_since: float | None = None
        self._evictions_seen: dict[str, int] = {}
        store_policy = StorePolicy(
            config.chunk_size,
            facts.block_size,
            config.saves_partial_chunks,
            config.extra_config.block_granular_tails and not config.discard_partial_chunks,
            config.save_decode_cache,
        )
        self.planner = StepPlanner(self, store_policy)
        # insight: what-if sizing, miss explanations, prefill saved, per-request summaries
        capacities = {name: t.capacity_bytes for name, t in self.tiers.items()} if facts.loads else {}
        self.whatif = WhatIfTracker(capacities) if capacities else None
        if self.whatif is not None:
            self.whatif.start()
        self._whatif_gauges: dict[str, float] = {}
        self._whatif_at = float("-inf")
        self._advice: dict[str, str] = {}
        self.first_chunks = FirstChunkNamespaces()
        self.prefill_cost = PrefillCostMeter()
        self._saved_seconds: dict[str, float] = {}
        self.done: list[RequestSummary] = []  # finished requests, drained by the facade
        self.info = instance_info(config, facts)
        self.block_events = BlockEvents(facts.block_size, facts.kv_events and facts.stores)

    def _check_budgets(self) -> None:
        if not self.facts.stores:
            return
        chunk = self.facts.chunk_nbytes(self.config.chunk_size)
        for name, tier in self.tiers.items():
            if chunk > tier.capacity_bytes:
                key = "max_local_cpu_size" if name == CPU else "max_local_disk_size"
                raise ConfigError(
                    f"KVLens config key '{key}' holds no chunk: one chunk of {self.config.chunk_size} "
                    f"tokens is {chunk} bytes"
                )

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

    def usable(self, tier: str) -> bool:
        """The workers did not report the tier skipped (remote: nor did this lookup client)."""
        if tier == REMOTE and self.remote is not None and not self.remote.usable():
            return False
        return self.tier_states.get(tier) is not TierState.SKIPPED

    def lookup(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens KVLens will load beyond vLLM's hit (side-effect free but for pins)."""
        self._merge_disk_scan()
        rid = request.request_id
        policy = self._policy(request)
        previous = self.lookups.get(rid)
        attempts = previous.attempts + 1 if previous is not None else 1
        skip = policy.skip_reason
        if skip is None and not self.facts.loads:
            skip = MissReason.PRODUCER_ROLE
        if skip is None and getattr(request, "skip_reading_prefix_cache", False):
            skip = MissReason.PROMPT_LOGPROBS  # vLLM would discard the answer: no pins, no hit
        if skip is not None:
            self.lookups[rid] = LookupResult([], 0, num_computed_tokens, 0, skip, attempts)
            self.pins.release(rid)
            return 0
        tokens = request.all_token_ids
        upto = max(len(tokens) - self.config.skip_last_n_tokens, 0)
        hits, first_missing, unhealthy, calls = self._find_hits(rid, tokens, upto)
        hit_tokens = hits[-1].key.end if hits else 0
        need = external_tokens(hit_tokens, num_computed_tokens, request.num_tokens)
        reason = miss_reason(
            upto, hit_tokens, num_computed_tokens, first_missing, self.recently_evicted, unhealthy
        )
        detail = None
        if reason is MissReason.EVICTED and first_missing is not None:
            detail = self.recently_evicted.detail(first_missing)
        elif reason is MissReason.NOT_STORED and not hits:
            reason, detail = self._other_namespace(rid, tokens, policy, reason)
        if 0 < need < self.config.min_retrieve_tokens:
            need, reason, detail = 0, MissReason.BELOW_MIN_RETRIEVE, None
        self.lookups[rid] = LookupResult(
            hits, hit_tokens, num_computed_tokens, need, reason, attempts, calls, miss_detail=detail
        )
        if need:
            self.pins.pin(rid, ((self.tiers[h.tier], h.key.hex) for h in hits if h.tier in self.tiers))
            if self.disk_view is not None:
                self.disk_view.pinned_for_load(h.key.hex for h in hits if h.tier == DISK)
        else:
            self.pins.release(rid)
        return need

    def _other_namespace(
        self, rid: str, tokens: Any, policy: RequestPolicy, reason: MissReason
    ) -> tuple[MissReason, dict[str, Any] | None]:
        """A first chunk never stored here may have been stored under another namespace."""
        namespace = policy.namespace
        if namespace is None or not self.first_chunks.others_than(namespace):
            return reason, None
        fingerprint = self.hashers[rid].fingerprint(tokens)
        other = self.first_chunks.other(fingerprint, namespace) if fingerprint else None
        if other is None:
            return reason, None
        return MissReason.OTHER_NAMESPACE, {"differs_in": namespace_differences(namespace, other)}

    def _find_hits(
        self, rid: str, tokens: Any, upto: int
    ) -> tuple[list[ChunkHit], str | None, bool, list[RemoteCall]]:
        """The stored chunks of the prompt's prefix (local tiers, then the remote); the first
        missing whole chunk; whether it sits only in a skipped tier; the remote round trips."""
        hits: list[ChunkHit] = []
        local = self._usable_tiers()
        hasher = self.hashers[rid]
        keys = hasher.keys(tokens, include_partial=False, upto=upto)
        first_missing, unhealthy = self._probe_local(keys, local, hits)
        if (len(hits) == len(keys) or self.remote is not None) and self._tail_may_be_stored(hasher, upto):
            tail = hasher.tail_key(tokens, upto)
            if tail is not None:
                keys.append(tail)
                if len(hits) == len(keys) - 1:
                    first_missing, unhealthy = self._probe_local([tail], local, hits)
        calls: list[RemoteCall] = []
        if self.config.extra_config.block_granular_tails:
            self._extend_by_blocks(rid, tokens, upto, hits, local)
        if (
            self.remote is not None
            and len(hits) < len(keys)
            and not (hits and hits[-1].key.num_tokens < self.config.chunk_size)
        ):
            first_missing = self._extend_from_remote(rid, tokens, upto, keys, hits, calls, first_missing)
            unhealthy = unhealthy or (len(hits) < len(keys) and not self.usable(REMOTE))
        return hits, first_missing, unhealthy, calls

    def _tail_may_be_stored(self, hasher: PrefixHasher, upto: int) -> bool:
        """The prompt's unfull last chunk is worth hashing: the directory (if exact) lists it."""
        full_end = upto - upto % self.config.chunk_size
        return self.tails is None or self.tails.holds(hasher.parent_at(full_end), upto - full_end)

    def _probe_local(
        self, keys: list[ChunkKey], local: list[TierIndex], hits: list[ChunkHit]
    ) -> tuple[str | None, bool]:
        """Add the chunks of ``keys`` that ``local`` holds, up to the first missing one; that
        one's name if it is a whole chunk, and whether it sits only in a skipped tier."""
        for key in keys:
            name = key.hex
            tier = _holder(local, name)
            if tier is None:
                whole = key.num_tokens == self.config.chunk_size
                return (name if whole else None), any(name in t for t in self.tiers.values())
            hits.append(ChunkHit(key, tier.name))
        return None, False

    def _extend_from_remote(
        self,
        rid: str,
        tokens: Any,
        upto: int,
        keys: list[ChunkKey],
        hits: list[ChunkHit],
        calls: list[RemoteCall],
        first_missing: str | None,
    ) -> str | None:
        """Continue the prefix with chunks the remote holds: one round trip for all of them."""
        if not self.usable(REMOTE):
            return first_missing
        rest = keys[len(hits) :]
        full = [k for k in rest if k.num_tokens == self.config.chunk_size]
        tail_start = full[-1].end if full else (hits[-1].key.end if hits else 0)
        parent = self.hashers[rid].parent_of(full[-1] if full else (hits[-1].key if hits else None))
        tails = [k for k in rest if k.num_tokens < self.config.chunk_size]
        if self.config.extra_config.block_granular_tails:
            chunk = tokens[tail_start : min(upto, tail_start + self.config.chunk_size)]
            cut = block_aligned_keys(parent, chunk, tail_start, self.config.chunk_size, self.facts.block_size)
            tails += [k for k in cut if all(k.num_tokens < t.num_tokens for t in tails)]
        candidates = full + tails
        present, call = self.remote.present(rid, [k.hex for k in candidates])  # type: ignore[union-attr]
        if call is not None:
            calls.append(call)
        for key, there in zip(full, present, strict=False):
            if not there:
                return key.hex
            hits.append(ChunkHit(key, REMOTE))
        for key, there in zip(tails, present[len(full) :], strict=True):  # longest first
            if there:
                hits.append(ChunkHit(key, REMOTE))
                break
        return None

    def _usable_tiers(self) -> list[TierIndex]:
        """The local tiers a lookup may answer from, fastest first."""
        return [t for t in self.tiers.values() if self.usable(t.name)]

    def _extend_by_blocks(
        self, rid: str, tokens: Any, upto: int, hits: list[ChunkHit], local: list[TierIndex]
    ) -> None:
        """After the last whole-chunk hit, take the longest stored whole-block prefix of the next chunk."""
        last = hits[-1].key if hits else None
        if last is not None and last.num_tokens < self.config.chunk_size:
            return  # the hit already ends in an unfull chunk
        start = last.end if last is not None else 0
        parent = self.hashers[rid].parent_of(last)
        chunk = tokens[start : min(upto, start + self.config.chunk_size)]
        size, block = self.config.chunk_size, self.facts.block_size
        if self.tails is not None:
            prefixes = self.tails.prefixes(parent, chunk, size, block)
        else:
            prefixes = block_prefixes(parent, chunk, size, block)
        for length, digest in prefixes:
            tier = _holder(local, digest.hex())
            if tier is not None:
                hits.append(ChunkHit(ChunkKey(digest, start, length), tier.name))
                return

    def after_alloc(self, request: Any, num_external_tokens: int) -> LookupOutcome | None:
        """vLLM allocated blocks: the lookup is final. Its outcome, for telemetry."""
        rid = request.request_id
        self.unfinished[rid] = request
        result = self.lookups.get(rid)
        if result is None:
            if num_external_tokens <= 0:
                return None
            result = self.lookups[rid] = LookupResult([], 0, 0, 0)
        if num_external_tokens > result.num_external_tokens:
            logger.error(
                "KVLens: vLLM allocated %d external tokens for %s but only %d can be loaded; "
                "the rest are reported as failed blocks",
                num_external_tokens,
                rid,
                result.num_external_tokens,
            )
            result.unloadable_tokens = num_external_tokens - result.num_external_tokens
        result.num_external_tokens = min(num_external_tokens, result.num_external_tokens)
        result.can_load = result.num_external_tokens > 0
        if not result.can_load:
            self.pins.release(rid)
        if rid not in self.trackers:  # first schedule (a preempted request is not counted again)
            self._note_references(request, result)
        return self.lookup_outcome(request, result, scheduled=True)

    def _note_references(self, request: Any, result: LookupResult) -> None:
        """Feed the what-if curves and the namespace memory with this request's chunks."""
        rid = request.request_id
        policy, hasher = self.policies.get(rid), self.hashers.get(rid)
        if policy is None or hasher is None or policy.namespace is None:
            return
        stores = policy.save_skip_reason is None and self.facts.stores
        size = self.config.chunk_size
        if stores:
            fingerprint = hasher.fingerprint(request.all_token_ids)
            if fingerprint is not None:
                self.first_chunks.note(fingerprint, policy.namespace)
        if self.whatif is None:
            return
        nbytes = self.facts.chunk_nbytes
        for hit in result.hits:
            self.whatif.record(None, hit.key.digest, nbytes(hit.key.num_tokens))
        whole = [h for h in result.hits if h.key.num_tokens == size]
        rest = hasher.full_keys(len(whole) * size, _prompt_tokens(request))
        for key in rest if stores else rest[:1]:  # the missed chunk, then those this request stores
            self.whatif.record(None, key.digest, nbytes(size))

    def lookup_outcome(self, request: Any, result: LookupResult, scheduled: bool) -> LookupOutcome:
        policy = self.policies.get(request.request_id)
        return LookupOutcome(
            request_id=request.request_id,
            prompt_tokens=_prompt_tokens(request),
            vllm_cached_tokens=result.vllm_cached_tokens,
            hit_tokens=result.hit_tokens,
            hit_tokens_by_tier=tokens_by_tier(result.hits, 0, result.hit_tokens),
            external_tokens=result.num_external_tokens if scheduled and result.can_load else 0,
            chunks=len(result.hits),
            miss_reason=result.miss_reason,
            save_skip_reason=policy.save_skip_reason if policy is not None else None,
            scheduled=scheduled,
            resumed=request.request_id in self.trackers,
            trace_context=trace_headers(request),
            attempts=result.attempts,
            remote_calls=tuple(result.remote_calls),
            ignored_params=policy.ignored_params if policy is not None else 0,
        )

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
        for tracker, _params in self._late.values():  # never reported: log as is
            self.done.append(_summary(tracker))
        self._late.clear()
        plan = StepPlan(writes=list(self._pending_evictions))
        self._pending_evictions = []
        self.planner.plan(plan, scheduler_output)
        self.block_events.planned(plan)
        plan.drain = not self.unfinished and self.has_pending_work()
        self._measure_step(scheduler_output, bool(plan.loads))
        return plan

    def _measure_step(self, scheduler_output: Any, loads: bool) -> None:
        scheduled: dict[str, int] = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        prefill = 0
        for rid, n in scheduled.items():
            request = self.unfinished.get(rid)
            if request is not None:
                done = getattr(request, "num_computed_tokens", 0)
                prefill += min(n, max(_prompt_tokens(request) - done, 0))
        self.prefill_cost.step(self._clock(), prefill, sum(scheduled.values()), scheduled.keys(), loads)

    def evict_later(self, tier: str, names: list[str]) -> None:
        if not names:
            return
        if self.facts.stores:  # a consumer never deletes
            self._pending_evictions.extend(Eviction(tier, n) for n in names)
        if tier == DISK and self.disk_view is not None:
            self.disk_view.note_changed(names)

    def _merge_disk_scan(self) -> None:
        if self.disk_view is not None:
            victims = self.disk_view.merge()
            self.recently_evicted.add(victims, DISK)
            self.evict_later(DISK, victims)

    # ---- feedback -----------------------------------------------------------------------
    def on_worker_report(self, report: WorkerReport) -> dict[str, int]:
        """Apply what the workers did; returns, per failed load, the tokens vLLM recomputes."""
        for tier, state in report.tier_states.items():
            self.tier_states[tier] = state
        recomputed: dict[str, int] = {}
        for rid, outcome in report.loads.items():
            self.pins.release(rid)
            self._forget_failed_load(outcome)
            self.suspects.add(outcome.failed_block_ids)
            late = self._late.pop(rid, None)
            tracker = late[0] if late is not None else self.trackers.get(rid)
            for tier, n in outcome.tokens_by_tier().items():
                self._saved_seconds[tier] = self._saved_seconds.get(tier, 0.0) + self.prefill_cost.saved(n)
            if tracker is not None:
                affected = tracker.record_load(outcome)
                if late is not None:
                    if late[1] is not None:
                        late[1]["kvlens"] = tracker.usage()
                    self.done.append(_summary(tracker))
                if affected:
                    recomputed[rid] = affected
        for failure in report.store_failures:
            self._forget(failure.tier, failure.name, failure.reason)
        for kept in report.kept:
            index = self.tiers.get(kept.tier)
            if index is not None:
                index.add_known(kept.name, kept.nbytes, most_recent=True)
        self._pending_writes = report.pending_writes
        return recomputed

    def _forget_failed_load(self, outcome: LoadOutcome) -> None:
        """A failed chunk and every later chunk of that prefix in the same tier leave the index."""
        failed_tiers: set[str] = set()
        for chunk in outcome.chunks:
            if chunk.reason is FailureReason.PREFIX_FAILED:
                if chunk.planned_tier in failed_tiers:
                    self._forget(chunk.planned_tier, chunk.name, chunk.reason)
            elif chunk.reason is not None and chunk.reason is not FailureReason.TIER_UNHEALTHY:
                failed_tiers.add(chunk.planned_tier)
                self._forget(chunk.planned_tier, chunk.name, chunk.reason)

    def _forget(self, tier: str, name: str, reason: FailureReason) -> None:
        index = self.tiers.get(tier)
        if index is not None and index.remove(name):
            logger.info("KVLens: dropped chunk %s from the %s tier (%s)", name[:12], tier, reason.value)
            self.evict_later(tier, [name])  # every rank deletes its share

    # ---- finish, reset, shutdown --------------------------------------------------------
    def finish(self, request: Any) -> FinishResult:
        rid = request.request_id
        self.pins.release(rid)
        if self.remote is not None:
            self.remote.forget(rid)
        self.unfinished.pop(rid, None)
        self.policies.pop(rid, None)
        self.hashers.pop(rid, None)
        result = self.lookups.pop(rid, None)
        tracker = self.trackers.pop(rid, None)
        unscheduled = None
        if tracker is None and result is not None:
            unscheduled = self.lookup_outcome(request, result, scheduled=False)
        params = self._response_params(tracker, result, unscheduled)
        if tracker is not None and tracker.load_pending:  # its load is reported later this step
            self._late[rid] = (tracker, params)
        elif tracker is not None:
            self.done.append(_summary(tracker))
        elif unscheduled is not None:
            self.done.append(_unscheduled_summary(unscheduled, result))
        return FinishResult(params, unscheduled)

    def _response_params(
        self, tracker: RequestTracker | None, result: LookupResult | None, unscheduled: LookupOutcome | None
    ) -> dict[str, Any] | None:
        """The response's kv_transfer_params (None when usage details are turned off)."""
        if not self.config.extra_config.enable_cache_usage_details_in_response:
            return None
        hit = tracker.hit_tokens if tracker else (result.hit_tokens if result else 0)
        params: dict[str, Any] = {"num_lmcache_cached_tokens": hit}
        if tracker is not None:
            params["kvlens"] = tracker.usage()
        elif unscheduled is not None:
            params["kvlens"] = {
                "vllm_cached_tokens": unscheduled.vllm_cached_tokens,
                "hit_tokens": unscheduled.hit_tokens,
                "miss_reason": unscheduled.miss_reason.value if unscheduled.miss_reason else None,
            }
            if result is not None and result.miss_detail:
                params["kvlens"]["miss_detail"] = result.miss_detail
        return params

    def take_done(self) -> list[RequestSummary]:
        done, self.done = self.done, []
        return done

    def take_saved_seconds(self) -> dict[str, float]:
        """Estimated prefill seconds saved per tier since the last call."""
        saved, self._saved_seconds = self._saved_seconds, {}
        return saved

    def has_pending_work(self) -> bool:
        """Background writes still queued: keep the engine stepping (bounded) until they land."""
        if self._pending_writes <= 0 or self.unfinished:
            self._draining_since = None
            return self._pending_writes > 0
        now = self._clock()
        if self._draining_since is None:
            self._draining_since = now
        return now - self._draining_since < MAX_DRAIN_S

    def take_evictions(self) -> dict[str, int]:
        """Chunks each tier evicted to make room since the last call."""
        out = {}
        for name, tier in self.tiers.items():
            seen = self._evictions_seen.get(name, 0)
            if tier.evictions != seen:
                out[name] = max(tier.evictions - seen, 0)
                self._evictions_seen[name] = tier.evictions
        return out

    def reset(self) -> bool:
        """Forget every unpinned chunk (vLLM's reset_prefix_cache with reset_connector)."""
        for tier in self.tiers.values():
            names = tier.clear()
            self.recently_evicted.add(names, tier.name)
            self.evict_later(tier.name, names)
        return True

    def shutdown(self) -> None:
        if self.whatif is not None:
            self.whatif.close()
        if self.disk_view is not None:
            self.disk_view.stop()
        if self.remote is not None:
            self.remote.close()

    def sizes(self) -> dict[str, int]:
        """Internal sizes, for leak-spotting gauges."""
        out = {
            "request_trackers": len(self.trackers),
            "load_specs": len(self.lookups),
            "unfinished_requests": len(self.unfinished),
            "pinned_requests": len(self.pins),
            "pending_saves": sum(
                1 for t in self.trackers.values() if t.save_skip_reason is None and not t.prefill_done
            ),
            "suspect_blocks": len(self.suspects),
        }
        for name, tier in self.tiers.items():
            out[f"tier_chunks|{name}"] = len(tier)
            out[f"tier_used_bytes|{name}"] = tier.used_bytes
            out[f"tier_capacity_bytes|{name}"] = tier.capacity_bytes
            out[f"pinned_chunks|{name}"] = tier.pinned_keys
            out[f"pinned_bytes|{name}"] = tier.pinned_bytes
            out[f"tier_health|{name}"] = self.tier_states[name].level
        if REMOTE in self.tier_states:
            state = self.tier_states[REMOTE]
            if self.remote is not None and not self.remote.health.usable():
                state = TierState.SKIPPED
            out["tier_health|remote"] = state.level
        out.update(self.insight_gauges())
        return out

    def insight_gauges(self) -> dict[str, float]:
        """The instance's identity, the what-if curves (read at most once a second) and the
        measured prefill cost per token."""
        out: dict[str, float] = {self.info: 1}
        cost = self.prefill_cost.seconds_per_token
        if cost is not None:
            out["prefill_seconds_per_token"] = cost
        if self.whatif is not None:
            now = self._clock()
            if now - self._whatif_at >= WHATIF_GAUGE_S:
                self._whatif_at = now
                self._whatif_gauges = {
                    f"whatif_hit_ratio|{tier}|{factor:g}": round(ratio, 4)
                    for tier, curve in self.whatif.snapshot().items()
                    for factor, ratio in curve.items()
                }
                self._log_advice()
            out.update(self._whatif_gauges)
        return out

    def _log_advice(self) -> None:
        """One log line when a tier's sizing advice changes."""
        assert self.whatif is not None
        for tier in self.tiers:
            advice = self.whatif.advice(tier)
            if advice is not None and self._advice.get(tier) != advice:
                self._advice[tier] = advice
                logger.info("KVLens sizing: %s", advice)


def _holder(tiers: list[TierIndex], name: str) -> TierIndex | None:
    """The first of ``tiers`` that holds the chunk (a plain loop: it runs per chunk of a lookup)."""
    for tier in tiers:
        if name in tier:
            return tier
    return None


def _prompt_tokens(request: Any) -> int:
    n = getattr(request, "num_prompt_tokens", None)
    if n is None:
        n = len(getattr(request, "prompt_token_ids", None) or ())
    return int(n)


def _summary(tracker: RequestTracker) -> RequestSummary:
    return RequestSummary(
        request_id=tracker.request_id,
        prompt_tokens=tracker.prompt_len,
        vllm_cached_tokens=tracker.vllm_cached_tokens,
        loaded_tokens=dict(tracker.loaded_tokens),
        miss_reason=tracker.miss_reason,
        miss_detail=tracker.miss_detail,
        load_seconds=tracker.load_seconds if tracker.planned_load_tokens else None,
        stored_chunks=tracker.stored_chunks,
        failed_blocks=tracker.failed_blocks,
        failure_reasons=tuple(tracker.failure_reasons),
        trace_context=tracker.trace_context,
    )


def _unscheduled_summary(outcome: LookupOutcome, result: LookupResult | None) -> RequestSummary:
    return RequestSummary(
        request_id=outcome.request_id,
        prompt_tokens=outcome.prompt_tokens,
        vllm_cached_tokens=outcome.vllm_cached_tokens,
        loaded_tokens={},
        miss_reason=outcome.miss_reason,
        miss_detail=result.miss_detail if result is not None else None,
        load_seconds=None,
        stored_chunks=0,
        failed_blocks=0,
        failure_reasons=(),
        trace_context=outcome.trace_context,
    )
