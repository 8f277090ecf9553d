"""KVLens's stores and evictions as vLLM KV cache events, for KV-aware routers.

Routers that follow vLLM's ``--kv-events-config`` stream (llm-d's precise prefix-cache scorer,
Dynamo's router) index which instance holds which blocks, by vLLM's own block hashes. KVLens
reports every chunk it stores as ``BlockStored`` and every chunk a tier drops as
``BlockRemoved``, with the tier as the ``medium`` (``cpu``, ``disk``, ``remote``), so a router
can send a request to the instance whose KVLens holds its prefix even after vLLM's own cache
let it go.

Events follow the plan the scheduler issues: a store is reported for the tiers it is written
to once its step is planned (a store withdrawn within the same plan is not reported), and a
chunk loaded from disk or Redis and kept in the CPU tier (a promotion) as a store in ``cpu``
once its load is planned; an
eviction, a failed chunk dropped, a reset, or another engine deleting it from a shared disk is
reported for each tier that held the chunk (and its tokens are forgotten); a reset or a clear of
every tier is also reported as ``AllBlocksCleared``.
Only whole vLLM blocks have hashes, so the unfull end of a chunk is not reported. The remote
tier is evicted by Redis itself: its chunks are reported stored and never removed. Pure logic:
the facade turns these into vLLM's event types.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .jobs import REMOTE, Eviction, StepPlan, StoreJob


@dataclass(frozen=True, slots=True)
class BlocksStored:
    medium: str
    block_hashes: tuple[Any, ...]  # vLLM's BlockHash values of the chunk's whole blocks
    parent_block_hash: Any | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    medium: str
    block_hashes: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class BlocksCleared:
    """Every tier of this engine was reset or cleared (vLLM's ``AllBlocksCleared``)."""


@dataclass(slots=True)
class _Chunk:
    hashes: tuple[Any, ...]
    parent: Any | None
    tokens: tuple[int, ...]
    lora: str | None
    tiers: set[str] = field(default_factory=set)


class BlockEvents:
    """Collects events between two ``take()`` calls; when disabled every call is a flag check."""

    def __init__(self, block_size: int, enabled: bool, max_chunks: int = 1 << 20) -> None:
        self.enabled = enabled
        self._bs = block_size
        self._chunks: dict[str, _Chunk] = {}
        self._events: list[BlocksStored | BlocksRemoved | BlocksCleared] = []
        self._max = max_chunks

    def __len__(self) -> int:
        return len(self._chunks)

    def describe(self, name: str, start: int, num_tokens: int, request: Any) -> None:
        """What a chunk about to be stored is, in vLLM's terms (its request's block hashes)."""
        if not self.enabled or name in self._chunks:
            return
        hashes: Sequence[Any] = getattr(request, "block_hashes", None) or ()
        first, end = start // self._bs, (start + num_tokens) // self._bs
        if end <= first or end > len(hashes):
            return  # no whole block, or vLLM has not hashed them (never for a prompt's blocks)
        if len(self._chunks) >= self._max:
            self._chunks.pop(next(iter(self._chunks)))
        lora = getattr(request, "lora_request", None)
        self._chunks[name] = _Chunk(
            tuple(hashes[first:end]),
            hashes[first - 1] if first > 0 else None,
            tuple(request.all_token_ids[first * self._bs : end * self._bs]),
            getattr(lora, "lora_name", None) if lora is not None else None,
        )

    def planned(self, plan: StepPlan) -> None:
        """The step's final plan: its stores and evictions, in order."""
        if not self.enabled:
            return
        for job in plan.writes:
            if isinstance(job, StoreJob):
                self._stored(job.name, job.tiers)
            elif isinstance(job, Eviction):
                self._removed(job.tier, job.name)

    def promoted(self, name: str, start: int, num_tokens: int, request: Any, tier: str) -> None:
        """A chunk read from a slower tier is kept in ``tier`` (planned with its load): a store
        there. If the copy never comes, the chunk's eviction reports it removed."""
        if self.enabled and request is not None:
            self.describe(name, start, num_tokens, request)
            self._stored(name, (tier,))

    def dropped(self, tier: str, names: Iterable[str]) -> None:
        """Chunks that left ``tier`` outside a plan (another engine deleted them from a shared disk)."""
        if self.enabled:
            for name in names:
                self._removed(tier, name)

    def _stored(self, name: str, tiers: Iterable[str]) -> None:
        chunk = self._chunks.get(name)
        if chunk is None:
            return
        for tier in tiers:
            if tier in chunk.tiers:
                continue
            self._events.append(
                BlocksStored(tier, chunk.hashes, chunk.parent, chunk.tokens, self._bs, chunk.lora)
            )
            if tier != REMOTE:  # Redis evicts on its own: nothing to pair a removal with
                chunk.tiers.add(tier)
        if not chunk.tiers:
            del self._chunks[name]

    def _removed(self, tier: str, name: str) -> None:
        chunk = self._chunks.get(name)
        if chunk is None or tier not in chunk.tiers:
            return
        chunk.tiers.discard(tier)
        self._events.append(BlocksRemoved(tier, chunk.hashes))
        if not chunk.tiers:
            del self._chunks[name]

    def cleared(self) -> None:
        """Every tier was reset or cleared: routers drop what they know of this instance. Chunks
        still reported removed one by one as their evictions are planned."""
        if self.enabled:
            self._events.append(BlocksCleared())

    def removed(self, tier: str, names: Iterable[str]) -> None:
        """Chunks a tier lost outside a plan's evictions (a clear deletes disk files itself)."""
        if self.enabled:
            for name in names:
                self._removed(tier, name)

    def take(self) -> list[BlocksStored | BlocksRemoved | BlocksCleared]:
        events, self._events = self._events, []
        return events
