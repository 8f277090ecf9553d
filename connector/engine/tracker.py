"""Per-request state on the scheduler and the pure planning of loads and stores."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .jobs import ChunkLoad
from .keys import ChunkKey, PrefixHasher, block_aligned_keys


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
    miss_reason: str | None = None
    can_load: bool = False  # set once vLLM allocated blocks for the external tokens

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
class RequestTracker:
    """What the scheduler knows about one scheduled request."""

    request_id: str
    prompt_len: int
    hasher: PrefixHasher
    tokens: list[int]  # tokens whose KV exists once the current step has run
    block_ids: list[int]
    saved_tokens: int  # chunks ending at or before this are stored (or known stored)
    hit_tokens: int = 0
    save_skip_reason: str | None = None
    stored_chunks: int = 0
    loaded_tokens: int = 0
    failed_blocks: int = 0
    miss_reason: str | None = None

    @property
    def prefill_done(self) -> bool:
        return len(self.tokens) >= self.prompt_len

    def advance(self, all_token_ids: Sequence[int], num_computed: int, num_scheduled: int) -> None:
        """Follow vLLM's view: ``num_computed`` tokens done, ``num_scheduled`` more this step.

        A smaller ``num_computed`` than we tracked means vLLM rolled the request back
        (failed blocks); stored chunks past the rollback are forgotten so they are redone.
        """
        if num_computed < len(self.tokens):
            del self.tokens[num_computed:]
            self.saved_tokens = min(self.saved_tokens, num_computed)
        target = min(num_computed + num_scheduled, len(all_token_ids))
        if len(self.tokens) < target:
            self.tokens.extend(all_token_ids[len(self.tokens) : target])

    def resume(
        self,
        all_token_ids: Sequence[int],
        block_ids: Sequence[int],
        num_computed: int,
        num_scheduled: int,
        hit_tokens: int,
    ) -> None:
        """A preempted request came back with new blocks; its KV must be rebuilt from there."""
        self.block_ids = list(block_ids)
        self.tokens = list(all_token_ids[: min(num_computed + num_scheduled, len(all_token_ids))])
        self.saved_tokens = hit_tokens
        self.hit_tokens = max(self.hit_tokens, hit_tokens)

    def store_candidates(
        self, chunk_size: int, save_partial: bool, save_decode: bool, block_size: int = 0
    ) -> list[ChunkKey]:
        """Chunks whose KV is complete after this step and not yet stored.

        At the end of the prompt, its unfull tail is stored too: cut to whole blocks when
        ``block_size`` is given (shareable by longer prompts), whole when ``save_partial``.
        """
        if self.save_skip_reason is not None:
            return []
        tokens: Sequence[int] = self.tokens if save_decode else self.tokens[: self.prompt_len]
        keys = self.hasher.keys(tokens, include_partial=False)
        tail_start = self.prompt_len - self.prompt_len % chunk_size
        if self.prefill_done and tail_start < self.prompt_len:
            prompt = self.tokens[: self.prompt_len]
            full = [k for k in self.hasher.keys(prompt, include_partial=False)]
            parent = self.hasher.parent_of(full[-1] if full else None)
            tails: list[ChunkKey] = []
            if block_size:
                tails += block_aligned_keys(parent, prompt, tail_start, chunk_size, block_size)[:1]
            if save_partial:
                exact = self.hasher.keys(prompt, include_partial=True)[-1]
                tails = [k for k in tails if k.num_tokens < exact.num_tokens] + [exact]
            # Decode tokens only ever fill whole chunks; the prompt's tails go in start order.
            keys = (
                [k for k in keys if k.end <= tail_start] + tails + [k for k in keys if k.start >= tail_start]
            )
        return [k for k in keys if k.end > self.saved_tokens]

    def blocks_of(self, key: ChunkKey, block_size: int) -> tuple[int, ...] | None:
        first, end = key.start // block_size, cdiv(key.end, block_size)
        if end > len(self.block_ids):
            return None
        return tuple(self.block_ids[first:end])
