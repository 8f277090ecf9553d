"""Segment keys: a segment's chunks keyed by the segment's own tokens, wherever it sits.

A prefix chunk's key chains over every token before it, so a document behind another system
prompt never matches. A segment's chunks chain from a *segment seed* instead: the namespace's
seed (model, dtype, KV layout, parallel size, LoRA, cache salt, tags: ``keys.Namespace``) hashed
under its own BLAKE2b personalization, then chained over the segment's chunks with the same
function as prefix chunks (``keys.chain``). So a segment key

- depends on the segment's tokens only, never on what precedes it in the prompt;
- is inside the same namespace as prefix chunks: another model, LoRA, cache salt or tag set never
  finds it, and a tier record of it names the same namespace fingerprint (``key_fingerprint``),
  so ``kvlens inspect``, ``kvlens clear --salt`` and tenant quotas treat it as any chunk;
- never equals a prefix chunk's key: a prefix chain starts from the namespace seed, a segment
  chain from the segment seed, and the two can meet only if BLAKE2b-128 under two
  personalizations collides (the same bound every key here rests on).

A segment is stored as LMCache stores blend segments: its whole ``chunk_size`` chunks from the
segment's first token, then its unfull tail (LMCache forces ``save_unfull_chunk`` for blending).
A chunk's key does not depend on whether the chunks before it are stored, so each chunk is
looked up on its own in every tier, and a segment can be partly reused.

Positions are not in the key: the same document is stored once, whichever prompt stored it. The
K of a stored chunk carries the rotary positions it was computed at, so its record carries the
position of its first token (``StoredAt``): a later prompt moves the chunk's K by
``new start - stored position`` (one delta for the whole chunk). LMCache keeps the same thing
as each memory object's ``cached_positions`` and rotates from them to the new positions at load.
Pure logic.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from .keys import DIGEST_SIZE, ChunkKey, Namespace, chain, chain_chunks
from .segments import Cut, Segment

SEGMENT_KEY_VERSION = b"kvlens-seg-v1"


@functools.lru_cache(maxsize=1024)
def segment_seed(namespace: Namespace) -> bytes:
    """The first parent of every segment chain of ``namespace`` (never a prefix chain's)."""
    return hashlib.blake2b(namespace.seed(), digest_size=DIGEST_SIZE, person=SEGMENT_KEY_VERSION).digest()


@dataclass(frozen=True, slots=True)
class SegmentChunk:
    """One stored chunk of a segment, as this prompt holds it."""

    digest: bytes
    start: int  # its first token's position in this prompt
    num_tokens: int
    segment: int  # the segment's index in this prompt's cut
    offset: int  # its first token's offset in the segment (a multiple of chunk_size)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def key(self) -> ChunkKey:
        """The chunk as the index and the tiers know chunks (a digest, where, how long)."""
        return ChunkKey(self.digest, self.start, self.num_tokens)


def segment_chunks(
    namespace: Namespace, tokens: Sequence[int], segment: Segment, chunk_size: int
) -> list[SegmentChunk]:
    """The keys of ``segment``'s whole chunks and of its unfull tail, in order."""
    own = tokens[segment.start : segment.end]
    n = len(own)
    full_end = n - n % chunk_size
    parent = segment_seed(namespace)
    digests = chain_chunks(parent, own[:full_end], chunk_size) if full_end else []
    out = [
        SegmentChunk(d, segment.start + at, chunk_size, segment.index, at)
        for d, at in zip(digests, range(0, full_end, chunk_size), strict=True)
    ]
    if full_end < n:
        tail_parent = digests[-1] if digests else parent
        tail = chain(tail_parent, own[full_end:])
        out.append(SegmentChunk(tail, segment.start + full_end, n - full_end, segment.index, full_end))
    return out


def cut_chunks(namespace: Namespace, tokens: Sequence[int], cut: Cut, chunk_size: int) -> list[SegmentChunk]:
    """The chunks of every reusable segment of ``cut``, in prompt order."""
    return [c for s in cut.reusable() for c in segment_chunks(namespace, tokens, s, chunk_size)]


@dataclass(frozen=True, slots=True)
class StoredAt:
    """What a segment chunk's record says about its KV beyond the key: where it was computed."""

    position: int  # rotary position of the chunk's first token when its KV was computed

    def delta(self, chunk: SegmentChunk) -> int:
        """How far the chunk's K must be rotated to sit at ``chunk.start`` (0: where it was)."""
        return chunk.start - self.position


class Computed(Enum):
    """Why a range of a blended prompt is computed rather than loaded."""

    SEPARATOR = "separator"  # the separator's own tokens are never stored
    SHORT_SEGMENT = "short_segment"  # a segment shorter than blend_min_tokens
    NOT_STORED = "not_stored"  # a chunk of a reusable segment that no tier holds


@dataclass(frozen=True, slots=True)
class Reuse:
    """What a blended prompt loads and what it computes, covering every token once, in order."""

    loaded: tuple[SegmentChunk, ...]
    computed: tuple[tuple[int, int, Computed], ...]  # [start, end) and why

    @property
    def loaded_tokens(self) -> int:
        return sum(c.num_tokens for c in self.loaded)


def plan_reuse(
    cut: Cut, chunks: Iterable[SegmentChunk], stored: Callable[[bytes], bool], num_tokens: int
) -> Reuse:
    """Which chunks load (``stored`` says a tier holds the digest) and which ranges compute, why."""
    loaded = [c for c in chunks if stored(c.digest)]
    spans: list[tuple[int, int, Computed | None]] = [(c.start, c.end, None) for c in loaded]
    spans += [(a, b, Computed.SEPARATOR) for a, b in cut.separators]
    spans += [(s.start, s.end, Computed.SHORT_SEGMENT) for s in cut.segments if not s.reusable]
    spans.sort(key=lambda span: span[0])
    computed: list[tuple[int, int, Computed]] = []
    at = 0
    for start, end, why in [*spans, (num_tokens, num_tokens, None)]:
        if start > at:
            computed.append((at, start, Computed.NOT_STORED))
        if why is not None and end > start:
            computed.append((start, end, why))
        at = max(at, end)
    return Reuse(tuple(loaded), tuple(computed))
