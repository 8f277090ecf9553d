"""Per-request state on the scheduler and the pure planning of loads and stores.

``RequestTracker`` is the one record per request: what vLLM has computed, what KVLens stored,
and what KVLens did for it (hits, loads, failures), which becomes the response's usage.
Per-step work is proportional to the step's new tokens: chunk keys are hashed once, stores
resume where the last step stopped, and a decoding request with nothing left to store costs
a couple of comparisons.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .jobs import ChunkLoad
from .keys import ChunkKey, PrefixHasher, block_prefixes, chain
from .outcomes import FailureReason, LoadOutcome, MissReason, RemoteCall, SaveSkipReason


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class ChunkHit:
    key: ChunkKey
    tier: str


@dataclass(slots=True)
class LookupResult:
    """The outcome of one prefix lookup, kept until the request is scheduled."""

    hits: list[ChunkHit]
    hit_tokens: int  # tokens KVLens holds for this prompt (num_lmcache_cached_tokens)
    vllm_cached_tokens: int  # block-aligned tokens vLLM already had
    num_external_tokens: int  # tokens KVLens will load (what the lookup returned)
    miss_reason: MissReason | None = None
    attempts: int = 1
    remote_calls: list[RemoteCall] = field(default_factory=list)
    can_load: bool = False  # set once vLLM allocated blocks for the external tokens
    unloadable_tokens: int = 0  # external tokens vLLM allocated beyond what KVLens can load
    miss_detail: dict[str, Any] | None = None  # e.g. the tier and age of an eviction
    # Asynchronous load (a chunk on a slow tier): the request waits outside the batch while
    # the workers load (its outcome waits in the scheduler state for the request's schedule).
    load_async: bool = False
    async_planned: bool = False

    @property
    def load_end(self) -> int:
        return self.vllm_cached_tokens + self.num_external_tokens


def tokens_by_tier(hits: Sequence[ChunkHit], start: int, end: int) -> dict[str, int]:
    """How many of the tokens in [start, end) each tier holds, from a lookup's hits."""
    by_tier: dict[str, int] = {}
    for hit in hits:
        overlap = min(hit.key.end, end) - max(hit.key.start, start)
        if overlap > 0:
            by_tier[hit.tier] = by_tier.get(hit.tier, 0) + overlap
    return by_tier


def external_tokens(hit_tokens: int, vllm_cached: int, num_tokens: int) -> int:
    """Tokens to load beyond vLLM's own hit; a full-prompt hit leaves the last token to compute."""
    need = hit_tokens - vllm_cached
    if hit_tokens >= num_tokens:
        need -= 1
    return max(need, 0)


def plan_chunk_loads(
    hits: Sequence[ChunkHit],
    block_ids: Sequence[int],
    block_size: int,
    load_start: int,
    load_end: int,
) -> list[ChunkLoad]:
    """The blocks of each hit chunk to write: those in [load_start, load_end) tokens.

    Blocks vLLM already holds (below ``load_start``, block aligned) are never written, so a
    block another request shares is never touched.
    """
    first_needed = load_start // block_size
    end_needed = cdiv(load_end, block_size)
    loads: list[ChunkLoad] = []
    for hit in hits:
        chunk_first = hit.key.start // block_size
        chunk_end = cdiv(hit.key.end, block_size)
        lo, hi = max(chunk_first, first_needed), min(chunk_end, end_needed)
        if lo >= hi:
            continue
        if hi > len(block_ids):
            raise ValueError(f"load needs block {hi - 1} but only {len(block_ids)} are allocated")
        tokens = min(hit.key.end, load_end) - max(hit.key.start, lo * block_size)
        loads.append(ChunkLoad(hit.key.hex, hit.tier, tuple(block_ids[lo:hi]), lo - chunk_first, tokens))
    return loads


@dataclass(slots=True)
class StorePolicy:
    chunk_size: int
    block_size: int
    save_partial: bool  # the exact unfull tail of a prompt (save_unfull_chunk)
    block_tails: bool  # the unfull tail cut to whole blocks (block_granular_tails)
    save_decode: bool


@dataclass(slots=True)
class RequestTracker:
    """What the scheduler knows about one scheduled request, and what KVLens did for it."""

    request_id: str
    prompt_len: int
    hasher: PrefixHasher
    block_ids: list[int]
    computed: int  # tokens whose KV exists once the current step has run
    saved_tokens: int  # chunks ending at or before this are stored (or known stored)
    save_skip_reason: SaveSkipReason | None = None
    trace_context: dict[str, str] | None = None
    tails_done: bool = False
    # usage, reported in the response
    vllm_cached_tokens: int = 0
    hit_tokens: int = 0
    planned_load_tokens: int = 0
    loaded_tokens: dict[str, int] = field(default_factory=dict)
    load_seconds: float = 0.0
    load_pending: bool = False
    failed_blocks: int = 0
    recomputed_tokens: int = 0
    miss_reason: MissReason | None = None
    miss_detail: dict[str, Any] | None = None
    stored_chunks: int = 0
    failure_reasons: list[str] = field(default_factory=list)

    @property
    def prefill_done(self) -> bool:
        return self.computed >= self.prompt_len

    def advance(self, num_computed: int, num_scheduled: int, num_tokens: int) -> None:
        """Follow vLLM's view: ``num_computed`` tokens done, ``num_scheduled`` more this step.

        A smaller ``num_computed`` than tracked means vLLM rolled the request back (failed
        blocks): chunks past the rollback are planned again.
        """
        if num_computed < self.computed:
            self.saved_tokens = min(self.saved_tokens, num_computed)
            if num_computed < self.prompt_len:
                self.tails_done = False
        self.computed = min(num_computed + num_scheduled, num_tokens)

    def resume(
        self, block_ids: Sequence[int], num_computed: int, num_scheduled: int, num_tokens: int
    ) -> None:
        """A preempted request came back with new blocks; its KV is rebuilt from there."""
        self.block_ids = list(block_ids)
        self.computed = min(num_computed + num_scheduled, num_tokens)
        self.saved_tokens = min(self.saved_tokens, num_computed)
        self.tails_done = self.tails_done and num_computed >= self.prompt_len

    def store_candidates(self, tokens: Sequence[int], policy: StorePolicy) -> list[ChunkKey]:
        """Chunks whose KV is complete after this step and not stored yet, in prefix order.

        ``tokens`` is the request's token list (vLLM's ``all_token_ids``); only the part
        not hashed before is read. At the end of the prompt its unfull tail is stored too,
        once: cut to whole blocks, and whole when ``save_partial``.
        """
        if self.save_skip_reason is not None:
            return []
        size = policy.chunk_size
        limit = self.computed if policy.save_decode else min(self.computed, self.prompt_len)
        tail_start = self.prompt_len - self.prompt_len % size
        full_end = limit - limit % size
        if self.saved_tokens >= full_end and (self.tails_done or not self.prefill_done):
            return []  # nothing new: the decode fast path
        self.hasher.extend(tokens, limit)
        keys = self.hasher.full_keys(self.saved_tokens, full_end)
        if self.prefill_done and not self.tails_done:
            self.tails_done = True
            tails = self._tails(tokens, policy, tail_start)
            if tails:
                before = [k for k in keys if k.end <= tail_start]
                after = [k for k in keys if k.start >= tail_start]
                keys = before + tails + after
        return [k for k in keys if k.end > self.saved_tokens]

    def _tails(self, tokens: Sequence[int], policy: StorePolicy, tail_start: int) -> list[ChunkKey]:
        if tail_start >= self.prompt_len:
            return []
        self.hasher.extend(tokens, tail_start)
        full = self.hasher.full_keys(0, tail_start)
        parent = self.hasher.parent_of(full[-1] if full else None)
        prompt_tail = tokens[tail_start : self.prompt_len]
        tails: list[ChunkKey] = []
        if policy.block_tails:  # the longest whole-block prefix: lookups probe every length
            for length, digest in block_prefixes(parent, prompt_tail, policy.chunk_size, policy.block_size):
                tails.append(ChunkKey(digest, tail_start, length))
                break
        if policy.save_partial:
            exact = ChunkKey(chain(parent, prompt_tail), tail_start, len(prompt_tail))
            tails = [k for k in tails if k.num_tokens < exact.num_tokens] + [exact]
        return tails

    def blocks_of(self, key: ChunkKey, block_size: int) -> tuple[int, ...] | None:
        first, end = key.start // block_size, cdiv(key.end, block_size)
        if end > len(self.block_ids):
            return None
        return tuple(self.block_ids[first:end])

    # ---- usage ----------------------------------------------------------------------
    def planned_load(self, tokens: int) -> None:
        self.planned_load_tokens = tokens
        self.load_pending = tokens > 0

    def record_load(self, outcome: LoadOutcome) -> int:
        """Merge a load outcome; returns the tokens vLLM recomputes because of it."""
        loaded = outcome.tokens_by_tier()
        for tier, n in loaded.items():
            self.loaded_tokens[tier] = self.loaded_tokens.get(tier, 0) + n
        self.load_seconds += outcome.seconds
        self.load_pending = False
        if not outcome.failed_block_ids:
            return 0
        self.failed_blocks += len(outcome.failed_block_ids)
        self.miss_reason, self.miss_detail = MissReason.LOAD_FAILED, None
        for chunk in outcome.failures():  # causes only: a later chunk of the prefix is not tried
            if chunk.reason in (None, FailureReason.PREFIX_FAILED):
                continue
            if chunk.reason.value not in self.failure_reasons:
                self.failure_reasons.append(chunk.reason.value)
        affected = max(self.planned_load_tokens - sum(loaded.values()), 0)
        self.recomputed_tokens += affected
        return affected

    def usage(self) -> dict[str, Any]:
        """The ``kvlens`` object of the response's ``kv_transfer_params``."""
        return {
            "vllm_cached_tokens": self.vllm_cached_tokens,
            "hit_tokens": self.hit_tokens,
            "loaded_tokens": dict(self.loaded_tokens),
            "load_ms": round(self.load_seconds * 1000, 3),
            "failed_blocks": self.failed_blocks,
            "recomputed_tokens": self.recomputed_tokens,
            "miss_reason": self.miss_reason.value if self.miss_reason else None,
            **({"miss_detail": self.miss_detail} if self.miss_detail else {}),
            "save_skip_reason": self.save_skip_reason.value if self.save_skip_reason else None,
        }
