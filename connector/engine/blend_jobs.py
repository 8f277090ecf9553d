"""What the scheduler asks the workers to blend, and what they report back (picklable, no torch).

A blended request reports the whole prompt but its last token to vLLM as the connector's
tokens; in the step that schedules it, every rank runs the blend before the forward pass: reads
the segment chunks the scheduler found (``SegmentChunkJob.tier``), computes the rest, writes its
K and V into the request's blocks, and stores the chunks it computed (``store_to``) from the
blend's own output. vLLM computes the last token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .outcomes import FailureReason


@dataclass(frozen=True, slots=True)
class SegmentChunkJob:
    name: str  # the segment chunk's key (hex); workers add their rank
    start: int  # its first token in this prompt
    num_tokens: int
    tier: str | None  # the tier to read it from; None: not stored anywhere the scheduler knows
    # Tiers admitted for it: written from the blend's output when computed, or with the payload
    # read from ``tier`` (a faster tier keeps what a slower one supplied). Never ``tier`` itself.
    store_to: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class BlendJob:
    request_id: str
    token_ids: tuple[int, ...]  # the prompt
    block_ids: tuple[int, ...]  # every block of the request, in order
    first: int  # tokens vLLM already holds (its prefix cache): the blend writes from here
    chunks: tuple[SegmentChunkJob, ...]  # the reusable segments' chunks, in prompt order
    namespace: str = ""  # key fingerprint written into disk and remote records
    trace_context: Mapping[str, str] | None = None

    @property
    def last(self) -> int:
        """The blend writes tokens ``first`` to ``last - 1``; vLLM computes the last token."""
        return len(self.token_ids) - 1


@dataclass(frozen=True, slots=True)
class ChunkProblem:
    tier: str
    name: str
    reason: FailureReason
    detail: str = ""


@dataclass(slots=True)
class BlendOutcome:
    """One rank's blend of one request (merged across ranks: the problems of every rank)."""

    request_id: str
    tokens: int = 0  # the prompt's
    reused_by_tier: dict[str, int] = field(default_factory=dict)  # tokens whose KV came from a tier
    recomputed: int = 0  # tokens computed through the last layer
    by_deviation: int = 0  # reused tokens recomputed because their K deviated most
    not_reused: int = 0  # tokens without stored KV (separators, short or missing segments, new text)
    deviation_mean: float | None = None  # at the first check layer, over the reused tokens
    deviation_max: float | None = None
    stored: int = 0  # chunks written to at least one tier
    written_tokens: int = 0  # tokens whose K and V went into vLLM's blocks
    problems: list[ChunkProblem] = field(default_factory=list)  # chunks not read (computed instead)
    failed: str | None = None  # the blend did not run: vLLM computes the tokens (why)
    failed_block_ids: list[int] = field(default_factory=list)
    seconds: float = 0.0
    ranks: int = 1

    @property
    def reused(self) -> int:
        return sum(self.reused_by_tier.values())

    def merge(self, other: BlendOutcome) -> None:
        self.problems.extend(p for p in other.problems if p not in self.problems)
        self.failed = self.failed or other.failed
        self.failed_block_ids = sorted(set(self.failed_block_ids) | set(other.failed_block_ids))
        self.seconds = max(self.seconds, other.seconds)
        self.stored = min(self.stored, other.stored)
        self.ranks += other.ranks

    def details(self) -> dict[str, object]:
        """The response's ``kvlens.blend`` entry."""
        out: dict[str, object] = {
            "tokens": self.tokens,
            "reused_tokens": dict(self.reused_by_tier),
            "recomputed_tokens": self.recomputed,
            "recomputed_by_deviation": self.by_deviation,
            "recomputed_not_stored": self.not_reused,
            "stored_chunks": self.stored,
        }
        if self.deviation_mean is not None:
            out["deviation_mean"] = round(self.deviation_mean, 6)
            out["deviation_max"] = round(self.deviation_max or 0.0, 6)
        if self.problems:
            out["unreadable_chunks"] = [{"tier": p.tier, "reason": p.reason.value} for p in self.problems]
        if self.failed:
            out["failed"] = self.failed
        return out
