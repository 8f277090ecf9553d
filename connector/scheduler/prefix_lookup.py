"""Prefix lookups: which stored chunks continue a prompt beyond vLLM's own hit.

Lookups answer from the scheduler's memory: the local tiers' indexes (no disk or network
round trip per chunk) and, for the shared remote tier that no index can know, one existence
round trip per request. Whole chunks are probed first, then the prompt's unfull tail and,
with block-granular tails, the longest stored whole-block prefix of the next chunk. The
chunks found are pinned until the load that uses them is reported.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..engine.index import TierIndex
from ..engine.jobs import CPU, DISK, REMOTE
from ..engine.keys import ChunkKey, PrefixHasher, block_aligned_keys, block_prefixes
from ..engine.namespace_marks import record_differences
from ..engine.namespaces import TENANT_PARTS, client_miss_reason, namespace_differences
from ..engine.outcomes import LookupOutcome, MissReason, RemoteCall
from ..engine.policy import RequestPolicy, decide_policy, miss_reason, trace_headers
from ..engine.tracker import ChunkHit, LookupResult, external_tokens, tokens_by_tier
from ..identity.checkpoint import AdapterFingerprints
from .scheduler_state import SchedulerState

logger = logging.getLogger("vllm.kvlens")

# Tiers whose loads run outside the step when asynchronous loading is on (a CPU-tier hit is a
# memory copy, cheaper in the step than a step's round trip).
SLOW_TIERS = frozenset({DISK, REMOTE})


class PrefixLookup:
    def __init__(self, state: SchedulerState) -> None:
        self._s = state
        self._chunk_size = state.config.chunk_size
        self._block_size = state.facts.block_size
        self._adapters = AdapterFingerprints()
        # The engine's measured prefill seconds per token (None: not measured yet).
        self.compute_cost: Callable[[], float | None] = lambda: None

    def policy(self, request: Any) -> RequestPolicy:
        """The request's policy (namespace, save rules), decided on its first lookup."""
        s = self._s
        rid = request.request_id
        policy = s.policies.get(rid)
        if policy is None:
            policy = decide_policy(
                s.base_namespace,
                rid,
                getattr(request, "kv_transfer_params", None),
                self._adapter(getattr(request, "lora_request", None)),
                getattr(request, "cache_salt", None),
                getattr(request, "priority", 0) or 0,
                bool(getattr(request, "mm_features", None))
                or getattr(request, "prompt_embeds", None) is not None
                or rid.startswith("mock_req"),  # data-parallel padding requests
                s.facts.kv_role,
                s.config.priority_limit,
                s.config.force_skip_save,
                s.config.extra_config.tag_keys,
                s.retention_rules,
                s.tenant_limits,
            )
            if policy.namespace is not None:  # a salt per request must not make a quota per request
                policy = replace(policy, tenant=s.tenants.label(policy.namespace))
            s.policies[rid] = policy
            if policy.tenant_refused is not None:
                s.tenants.refused(policy.tenant_refused)
            if policy.namespace is not None:
                s.hashers[rid] = PrefixHasher(policy.namespace, self._chunk_size)
        return policy

    def _adapter(self, lora: Any) -> str | None:
        """A LoRA request's identity: its adapter's content (a name can be re-pointed)."""
        if lora is None:
            return None
        path = getattr(lora, "lora_path", None) or getattr(lora, "path", None)
        if not path:
            return f"lora-name:{lora.lora_name}"
        return self._adapters.identity(str(path))

    def lookup(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens KVLens will load beyond vLLM's hit (side-effect free but for pins); None while
        the remote's answer is awaited (vLLM asks again)."""
        s = self._s
        s.merge_disk_scan()
        rid = request.request_id
        policy = self.policy(request)
        previous = s.lookups.get(rid)
        attempts = previous.attempts + 1 if previous is not None else 1
        skip = policy.skip_reason
        if skip is None and not s.facts.loads:
            skip = MissReason.PRODUCER_ROLE
        if skip is None and getattr(request, "skip_reading_prefix_cache", False):
            skip = MissReason.PROMPT_LOGPROBS  # vLLM would discard the answer: no pins, no hit
        if skip is not None:
            s.lookups[rid] = LookupResult([], 0, num_computed_tokens, 0, skip, attempts)
            s.pins.release(rid)
            return 0
        tokens = request.all_token_ids
        upto = max(len(tokens) - s.config.skip_last_n_tokens, 0)
        found = self._find_hits(rid, tokens, upto)
        if found is None:  # the remote's answer is on its way: vLLM asks again at its next step
            # Until then (and if the request ends first) the lookup stands as unanswered.
            s.lookups[rid] = LookupResult([], 0, num_computed_tokens, 0, MissReason.LOOKUP_TIMEOUT, attempts)
            s.pins.release(rid)
            return None
        hits, first_missing, unanswered, calls = found
        slow = self._drop_slower_than_recompute(hits, num_computed_tokens)
        hit_tokens = hits[-1].key.end if hits else 0
        need = external_tokens(hit_tokens, num_computed_tokens, request.num_tokens)
        reason = miss_reason(
            upto, hit_tokens, num_computed_tokens, first_missing, s.recently_evicted, unanswered
        )
        detail = None
        if slow is not None:
            reason, detail = MissReason.SLOWER_THAN_RECOMPUTE, slow
        elif reason is MissReason.EVICTED and first_missing is not None:
            detail = s.recently_evicted.detail(first_missing)
        elif reason is MissReason.NOT_STORED and not hits:
            reason, detail = self._other_namespace(rid, tokens, policy, reason)
        if 0 < need < s.config.min_retrieve_tokens:
            need = 0
            if reason is not MissReason.LOOKUP_TIMEOUT:  # the remote might have held more
                reason, detail = MissReason.BELOW_MIN_RETRIEVE, None
        s.lookups[rid] = LookupResult(
            hits,
            hit_tokens,
            num_computed_tokens,
            need,
            reason,
            attempts,
            calls,
            miss_detail=detail,
            load_async=bool(need)
            and (s.config.enable_async_loading or s.facts.failed_blocks_stay_cached)
            and any(h.tier in SLOW_TIERS and h.key.end > num_computed_tokens for h in hits)
            and not self._loads_in_step(rid, hits, num_computed_tokens),
        )
        if need:
            s.pins.pin(rid, ((s.tiers[h.tier], h.key.hex) for h in hits if h.tier in s.tiers))
            if s.disk_view is not None:
                s.disk_view.pinned_for_load(h.key.hex for h in hits if h.tier == DISK)
        else:
            s.pins.release(rid)
        return need

    def _loads_in_step(self, rid: str, hits: list[ChunkHit], vllm_cached: int) -> bool:
        """Whether a disk load is better made inside the step: no other request is in the
        engine (none would wait for it) and, as measured, it takes at most
        ``async_load_in_step_max_ms`` (an engine step stays short for requests arriving). A
        remote load always waits outside: a network stalls more often than a local disk.

        Never where vLLM keeps failed blocks cached (its ``recompute`` policy): a load in the
        step has its blocks in vLLM's prefix cache from the start, and one that fails leaves
        them there, unfilled, for any request (this step's, the next one vLLM already planned,
        or one arriving before the owner recomputed them) to compute over. A load outside the
        step has its blocks cached only once it is reported, and then only what loaded."""
        s = self._s
        budget_s = s.config.extra_config.async_load_in_step_max_ms / 1e3
        if budget_s <= 0 or s.facts.failed_blocks_stay_cached or any(other != rid for other in s.unfinished):
            return False
        total_s = 0.0
        for hit in hits:
            if hit.key.end <= vllm_cached:
                continue
            if hit.tier == REMOTE:
                return False
            seconds = s.tier_speeds.seconds(hit.tier, s.facts.chunk_nbytes(hit.key.num_tokens))
            if seconds is None:  # not measured yet: asynchronous, the safe choice
                return False
            total_s += seconds
        return total_s <= budget_s

    def _drop_slower_than_recompute(self, hits: list[ChunkHit], vllm_cached: int) -> dict[str, Any] | None:
        """Cut the hits at the first chunk whose tier loads it slower than the engine computes its
        tokens (both as measured); what the cut chunk would have cost, or None when nothing is cut."""
        s = self._s
        if not s.config.extra_config.load_only_if_faster:
            return None
        cost = self.compute_cost()
        if cost is None:
            return None
        rechecking: dict[str, bool] = {}  # a tier loaded from anyway, for this whole lookup
        for i, hit in enumerate(hits):
            tokens = hit.key.end - max(hit.key.start, vllm_cached)
            if tokens <= 0:
                continue
            load_s = s.tier_speeds.seconds(hit.tier, s.facts.chunk_nbytes(hit.key.num_tokens))
            compute_s = tokens * cost
            if load_s is None or load_s <= compute_s:
                continue
            if hit.tier not in rechecking:
                rechecking[hit.tier] = s.tier_speeds.recheck(hit.tier)
            if rechecking[hit.tier]:
                continue
            del hits[i:]
            return {
                "tier": hit.tier,
                "load_ms": round(load_s * 1e3, 3),
                "compute_ms": round(compute_s * 1e3, 3),
            }
        return None

    def _other_namespace(
        self, rid: str, tokens: Any, policy: RequestPolicy, reason: MissReason
    ) -> tuple[MissReason, dict[str, Any] | None]:
        """A first chunk never stored here may have been stored under another namespace: one of
        the request's own tenant (this instance's memory, then the shared stores' marks) before
        one of another tenant, which only the operator's views show (``namespaces.py``)."""
        s = self._s
        namespace, shared = policy.namespace, s.shared_marks
        if namespace is None:
            return reason, None
        local = s.first_chunks.others_than(namespace)
        if not local and (shared is None or not shared.view):  # no other namespace known
            if shared is not None:
                shared.wanted()
            return reason, None
        fingerprint = s.hashers[rid].fingerprint(tokens)
        if fingerprint is None:
            return reason, None
        found: list[list[str]] = []
        other = s.first_chunks.other(fingerprint, namespace) if local else None
        if other is not None:
            found.append(namespace_differences(namespace, other))
        record = shared.view.other(fingerprint, namespace) if shared is not None else None
        if record is not None:  # another instance's, from the store
            found.append(record_differences(namespace, record))
        elif shared is not None:
            shared.wanted()
        if not found:
            return reason, None
        own_tenant_first = min(found, key=lambda differs_in: bool(TENANT_PARTS & set(differs_in)))
        return MissReason.OTHER_NAMESPACE, {"differs_in": own_tenant_first}

    def _find_hits(
        self, rid: str, tokens: Any, upto: int
    ) -> tuple[list[ChunkHit], str | None, MissReason | None, list[RemoteCall]] | None:
        """The stored chunks of the prompt's prefix (local tiers, then the remote); the first
        missing whole chunk; why the tier that may hold it could not say (``tier_unhealthy``:
        it sits only in a skipped tier, or the remote is skipped; ``lookup_timeout``); the
        remote round trips. None: the remote's answer is still awaited."""
        s = self._s
        hits: list[ChunkHit] = []
        local = s.usable_tiers()
        hasher = s.hashers[rid]
        keys = hasher.keys(tokens, include_partial=False, upto=upto)
        first_missing, unhealthy = self._probe_local(keys, local, hits)
        if (len(hits) == len(keys) or s.remote is not None) and self._tail_may_be_stored(hasher, upto):
            tail = hasher.tail_key(tokens, upto)
            if tail is not None:
                keys.append(tail)
                if len(hits) == len(keys) - 1:
                    first_missing, unhealthy = self._probe_local([tail], local, hits)
        calls: list[RemoteCall] = []
        unanswered = MissReason.TIER_UNHEALTHY if unhealthy else None
        if s.config.extra_config.block_granular_tails:
            self._extend_by_blocks(hasher, tokens, upto, hits, local)
        if (
            s.remote is not None
            and len(hits) < len(keys)
            and not (hits and hits[-1].key.num_tokens < self._chunk_size)
        ):
            remote = self._extend_from_remote(hasher, rid, tokens, upto, keys, hits, calls, first_missing)
            if remote is None:
                return None
            first_missing, remote_unanswered = remote
            if unanswered is None and len(hits) < len(keys):
                unanswered = remote_unanswered
        return hits, first_missing, unanswered, calls

    def _tail_may_be_stored(self, hasher: PrefixHasher, upto: int) -> bool:
        """The prompt's unfull last chunk is worth hashing: the directory (if exact) lists it."""
        tails = self._s.tails
        full_end = upto - upto % self._chunk_size
        return tails is None or tails.holds(hasher.parent_at(full_end), upto - full_end)

    def _probe_local(
        self, keys: list[ChunkKey], local: list[TierIndex], hits: list[ChunkHit]
    ) -> tuple[str | None, bool]:
        """Add the chunks of ``keys`` that ``local`` holds, up to the first missing one; that
        one's name if it is a whole chunk, and whether it sits only in a skipped tier."""
        for key in keys:
            name = key.hex
            tier = self._holder(local, name)
            if tier is None:
                whole = key.num_tokens == self._chunk_size
                return (name if whole else None), any(name in t for t in self._s.tiers.values())
            hits.append(ChunkHit(key, tier.name))
        return None, False

    def _holder(self, local: list[TierIndex], name: str) -> TierIndex | None:
        """The tier to load ``name`` from. A chunk an asynchronous load is still promoting into
        the CPU tier is indexed there already but lands only when that load is reported: until
        then it is loaded from where it came from."""
        s = self._s
        if name in s.promoting:
            local = [t for t in local if t.name != CPU]
        if s.unreadable.any_tier(name):
            local = [t for t in local if not s.unreadable.unreadable(t.name, name)]
        held = s.held_stores.hidden_in(name)  # not written until every rank's loads are reported
        if held:
            local = [t for t in local if t.name not in held]
        return holder(local, name)

    def _extend_from_remote(
        self,
        hasher: PrefixHasher,
        rid: str,
        tokens: Any,
        upto: int,
        keys: list[ChunkKey],
        hits: list[ChunkHit],
        calls: list[RemoteCall],
        first_missing: str | None,
    ) -> tuple[str | None, MissReason | None] | None:
        """Continue the prefix with chunks the remote holds: one round trip for all of them.
        The first missing whole chunk, and why the remote could not say (None: it answered);
        None while its answer is awaited."""
        s = self._s
        if s.remote is None or not s.usable(REMOTE):
            return first_missing, MissReason.TIER_UNHEALTHY
        size = self._chunk_size
        rest = keys[len(hits) :]
        full = [k for k in rest if k.num_tokens == size]
        tail_start = full[-1].end if full else (hits[-1].key.end if hits else 0)
        parent = hasher.parent_of(full[-1] if full else (hits[-1].key if hits else None))
        tails = [k for k in rest if k.num_tokens < size]
        if s.config.extra_config.block_granular_tails:
            chunk = tokens[tail_start : min(upto, tail_start + size)]
            cut = block_aligned_keys(parent, chunk, tail_start, size, self._block_size)
            tails += [k for k in cut if all(k.num_tokens < t.num_tokens for t in tails)]
        candidates = full + tails
        answer = s.remote.present(rid, [k.hex for k in candidates])
        if answer.pending:
            return None
        if answer.call is not None:
            calls.append(answer.call)
        present, unreadable = answer.present, s.unreadable
        for key, there in zip(full, present, strict=False):
            if not there or unreadable.unreadable(REMOTE, key.hex):
                return key.hex, answer.unanswered
            hits.append(ChunkHit(key, REMOTE))
        for key, there in zip(tails, present[len(full) :], strict=True):  # longest first
            if there and not unreadable.unreadable(REMOTE, key.hex):
                hits.append(ChunkHit(key, REMOTE))
                break
        return None, answer.unanswered

    def _extend_by_blocks(
        self, hasher: PrefixHasher, tokens: Any, upto: int, hits: list[ChunkHit], local: list[TierIndex]
    ) -> None:
        """After the last whole-chunk hit, take the longest stored whole-block prefix of the next chunk."""
        last = hits[-1].key if hits else None
        if last is not None and last.num_tokens < self._chunk_size:
            return  # the hit already ends in an unfull chunk
        start = last.end if last is not None else 0
        parent = hasher.parent_of(last)
        chunk = tokens[start : min(upto, start + self._chunk_size)]
        size, block = self._chunk_size, self._block_size
        tails = self._s.tails
        if tails is not None:
            prefixes = tails.prefixes(parent, chunk, size, block)
        else:
            prefixes = block_prefixes(parent, chunk, size, block)
        for length, digest in prefixes:
            tier = self._holder(local, digest.hex())
            if tier is not None:
                hits.append(ChunkHit(ChunkKey(digest, start, length), tier.name))
                return

    # ---- the lookup made final ----------------------------------------------------------
    def after_alloc(self, request: Any, num_external_tokens: int) -> LookupResult | None:
        """vLLM allocated blocks for the request: its lookup is final (None: nothing to track,
        or the schedule that follows an asynchronous load, already counted)."""
        s = self._s
        rid = request.request_id
        s.unfinished[rid] = request
        result = s.lookups.get(rid)
        if result is not None:
            self._retain_hits(rid, result)
        if result is not None and result.async_planned:
            return None
        if result is None:
            if num_external_tokens <= 0:
                return None
            result = s.lookups[rid] = LookupResult([], 0, 0, 0)
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
            s.pins.release(rid)
        return result

    def _retain_hits(self, rid: str, result: LookupResult) -> None:
        """A scheduled request's retention reaches the chunks it hit, in every tier holding them."""
        policy = self._s.policies.get(rid)
        if policy is None or policy.retention is None:
            return
        for hit in result.hits:
            for tier in self._s.tiers.values():
                tier.retain(hit.key.hex, policy.retention)

    def outcome(self, request: Any, result: LookupResult, scheduled: bool) -> LookupOutcome:
        policy = self._s.policies.get(request.request_id)
        return LookupOutcome(
            request_id=request.request_id,
            prompt_tokens=prompt_tokens(request),
            vllm_cached_tokens=result.vllm_cached_tokens,
            hit_tokens=result.hit_tokens,
            hit_tokens_by_tier=tokens_by_tier(result.hits, 0, result.hit_tokens),
            external_tokens=result.num_external_tokens if scheduled and result.can_load else 0,
            chunks=len(result.hits),
            # /metrics and spans: what the client may see (the request log keeps the rest)
            miss_reason=client_miss_reason(result.miss_reason, result.miss_detail),
            save_skip_reason=policy.save_skip_reason if policy is not None else None,
            scheduled=scheduled,
            resumed=request.request_id in self._s.trackers,
            trace_context=trace_headers(request),
            attempts=result.attempts,
            remote_calls=tuple(result.remote_calls),
            ignored_params=policy.ignored_params if policy is not None else 0,
            retention_refused=policy.retention_refused if policy is not None else None,
        )

    def external_tokens_by_tier(self, request_id: str, num_external_tokens: int) -> dict[str, int]:
        """How the tokens about to be loaded split across tiers (for vLLM's hit-source metric)."""
        result = self._s.lookups.get(request_id)
        if result is None or num_external_tokens <= 0:
            return {}
        start = result.vllm_cached_tokens
        return tokens_by_tier(result.hits, start, start + num_external_tokens)


def holder(tiers: list[TierIndex], name: str) -> TierIndex | None:
    """The first of ``tiers`` that holds the chunk (a plain loop: it runs per chunk of a lookup)."""
    for tier in tiers:
        if name in tier:
            return tier
    return None


def prompt_tokens(request: Any) -> int:
    n = getattr(request, "num_prompt_tokens", None)
    if n is None:
        n = len(getattr(request, "prompt_token_ids", None) or ())
    return int(n)
