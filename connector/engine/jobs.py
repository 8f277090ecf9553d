"""Plain values that cross from the scheduler to the workers and back (picklable, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

CPU = "cpu"
DISK = "disk"
TIER_ORDER = (CPU, DISK)  # fastest first: a lookup and a load prefer the earlier tier


@dataclass(frozen=True, slots=True)
class ChunkLoad:
    name: str  # chunk digest (hex); workers add their rank
    tier: str
    block_ids: tuple[int, ...]  # vLLM blocks to write, in order
    first_block: int  # index, within the stored chunk, of the block written to block_ids[0]
    num_tokens: int  # tokens these blocks make valid for the request


@dataclass(frozen=True, slots=True)
class LoadJob:
    request_id: str
    chunks: tuple[ChunkLoad, ...]
    trace_context: dict[str, str] | None = None


@dataclass(frozen=True, slots=True)
class StoreJob:
    request_id: str
    name: str
    block_ids: tuple[int, ...]  # every block of the chunk, in order
    tiers: tuple[str, ...]
    num_tokens: int
    trace_context: dict[str, str] | None = None  # the request's W3C traceparent/tracestate


@dataclass(frozen=True, slots=True)
class Eviction:
    tier: str
    name: str


@dataclass(slots=True)
class StepPlan:
    """What the workers do in one engine step, in this order: loads, evictions, stores."""

    loads: list[LoadJob] = field(default_factory=list)
    evictions: list[Eviction] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)


@dataclass(slots=True)
class LoadOutcome:
    """How one request's load went on one worker (merged across tensor-parallel ranks)."""

    tokens_by_tier: dict[str, int] = field(default_factory=dict)
    failed_chunks: list[tuple[str, str, str]] = field(default_factory=list)  # name, tier, reason
    failed_block_ids: list[int] = field(default_factory=list)
    nbytes: int = 0
    seconds: float = 0.0

    def merge(self, other: LoadOutcome) -> None:
        for tier, n in other.tokens_by_tier.items():
            self.tokens_by_tier[tier] = min(self.tokens_by_tier.get(tier, n), n)
        self.failed_chunks.extend(c for c in other.failed_chunks if c not in self.failed_chunks)
        self.failed_block_ids = sorted(set(self.failed_block_ids) | set(other.failed_block_ids))
        self.nbytes += other.nbytes
        self.seconds = max(self.seconds, other.seconds)


@dataclass(slots=True)
class WorkerReport:
    """Worker to scheduler, once per step: finished loads and failed stores."""

    loads: dict[str, LoadOutcome] = field(default_factory=dict)
    store_failures: list[tuple[str, str, str]] = field(default_factory=list)  # name, tier, reason

    def is_empty(self) -> bool:
        return not (self.loads or self.store_failures)

    def merge(self, other: WorkerReport) -> WorkerReport:
        for req_id, outcome in other.loads.items():
            if req_id in self.loads:
                self.loads[req_id].merge(outcome)
            else:
                self.loads[req_id] = outcome
        self.store_failures.extend(other.store_failures)
        return self
