"""What the scheduler asks the workers to blend, and what they report back (picklable, no torch).

A blended request reports the whole prompt but its last token to vLLM as the connector's
tokens; in the step that schedules it, every rank runs the blend before the forward pass: reads
the segment chunks the scheduler found (``SegmentChunkJob.tier``), computes the rest, writes its
K and V into the request's blocks, and stores the chunks it computed (``store_to``) from the
blend's own output. vLLM computes the last token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


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
