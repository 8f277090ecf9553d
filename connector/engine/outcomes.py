"""What happened, as typed values: the connector's halves produce them, telemetry consumes them.

Reasons are closed enums (their values are the stable names used in metrics, spans, responses
and logs), never strings parsed back. Load outcomes and store failures also travel from the
workers to the scheduler in the ``WorkerReport`` (picklable, no torch).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

logger = logging.getLogger("vllm.kvlens")


class FailureReason(str, Enum):
    """Why a chunk could not be read or written."""

    MISSING = "missing"  # the tier does not hold it (deleted, evicted by someone else)
    CORRUPT = "corrupt"  # the tier holds something else or a damaged copy
    IO_ERROR = "io_error"  # the tier failed (disk error, connection refused, out of space)
    TIMEOUT = "timeout"  # the tier did not answer in time
    TIER_UNHEALTHY = "tier_unhealthy"  # skipped: the tier is marked unhealthy
    QUEUE_FULL = "queue_full"  # a store dropped because the tier's write queue was full
    DEPENDENCY_FAILED = "dependency_failed"  # its KV was computed over blocks that failed to load
    PREFIX_FAILED = "prefix_failed"  # an earlier chunk of the same prefix failed; not tried
    NOT_LOADABLE = "not_loadable"  # vLLM allocated external tokens KVLens cannot supply


class MissReason(str, Enum):
    """Why a lookup did not supply (all of) a prompt: one closed list."""

    NOT_STORED = "not_stored"  # the next chunk was never stored
    OTHER_NAMESPACE = (
        "other_namespace"  # its tokens were stored under another namespace (salt, tags, LoRA...)
    )
    EVICTED = "evicted"  # the next chunk was stored and evicted since
    PARTIAL_CHUNK = "partial_chunk"  # only an unfull chunk (or a part of a block) remains
    VLLM_HIT = "vllm_hit"  # vLLM's own prefix cache already held all KVLens has
    BELOW_MIN_RETRIEVE = "below_min_retrieve"  # fewer tokens than min_retrieve_tokens
    TIER_UNHEALTHY = "tier_unhealthy"  # the next chunk sits in a tier marked unhealthy
    # the remote's answer for the next chunk did not come within remote_lookup_timeout_ms
    LOOKUP_TIMEOUT = "lookup_timeout"
    PRODUCER_ROLE = "producer_role"  # kv_producer never loads
    PROMPT_LOGPROBS = "prompt_logprobs"  # vLLM skips cached KV (prompt logprobs requested)
    UNSUPPORTED_INPUT = "unsupported_input"  # multimodal, prompt embeddings, DP padding
    INVALID_PARAMS = "invalid_params"  # malformed lmcache.* request parameters
    LOAD_FAILED = "load_failed"  # found at lookup, but the load failed (blocks recomputed)
    SLOWER_THAN_RECOMPUTE = "slower_than_recompute"  # its tier loads slower than vLLM computes


class SaveSkipReason(str, Enum):
    """Why KVLens stores nothing for a request."""

    CONSUMER_ROLE = "consumer_role"
    FORCE_SKIP_SAVE = "force_skip_save"
    SKIP_SAVE = "skip_save"
    PRIORITY_LIMIT = "priority_limit"
    UNSUPPORTED_INPUT = "unsupported_input"
    INVALID_PARAMS = "invalid_params"
    BLENDED = "blended"  # its KV came from a blend: not a prefix's exact KV (its segments are stored)


class TierState(str, Enum):
    HEALTHY = "healthy"
    FAILING = "failing"  # errors seen, still used
    SKIPPED = "skipped"  # not used until a probe succeeds

    @property
    def level(self) -> int:
        """2 healthy, 1 failing, 0 skipped: the value of the health gauge."""
        return {TierState.HEALTHY: 2, TierState.FAILING: 1, TierState.SKIPPED: 0}[self]


REMOTE_OPERATIONS = ("exists", "get", "put", "delete")  # a RemoteCall's operation
# RemoteUnavailable.kind (tiers/redis_tier.py); "error" for anything else
REMOTE_ERROR_KINDS = ("timeout", "connection", "auth", "oom", "readonly", "cluster", "loading", "error")


@dataclass(frozen=True, slots=True)
class RemoteCall:
    """One round trip to the remote tier (for child spans and latency metrics)."""

    operation: str  # one of REMOTE_OPERATIONS
    start_ns: int
    end_ns: int
    keys: int
    nbytes: int = 0
    error: str | None = None  # one of REMOTE_ERROR_KINDS


@dataclass(frozen=True, slots=True)
class LookupOutcome:
    """A request's lookup once it is final (scheduled, or finished without being scheduled)."""

    request_id: str
    prompt_tokens: int
    vllm_cached_tokens: int  # block-aligned tokens vLLM's own prefix cache had
    hit_tokens: int  # tokens KVLens held (num_lmcache_cached_tokens)
    hit_tokens_by_tier: Mapping[str, int]
    external_tokens: int  # tokens KVLens loads (0 when not scheduled)
    chunks: int
    miss_reason: MissReason | None
    save_skip_reason: SaveSkipReason | None
    scheduled: bool
    resumed: bool  # a preempted request looked up again (count it once)
    trace_context: Mapping[str, str] | None = None
    attempts: int = 1
    remote_calls: tuple[RemoteCall, ...] = ()
    ignored_params: int = 0  # unknown lmcache.* request parameters (ignored)
    retention_refused: str | None = None  # why it got less retention than it asked (retention_rules)


@dataclass(slots=True)
class ChunkLoadResult:
    name: str
    planned_tier: str
    num_tokens: int
    tier: str | None = None  # the tier it was read from; None when it failed or was not tried
    reason: FailureReason | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.tier is not None


@dataclass(slots=True)
class LoadOutcome:
    """How one request's load went (merged across tensor-parallel ranks)."""

    request_id: str
    chunks: list[ChunkLoadResult] = field(default_factory=list)
    failed_block_ids: list[int] = field(default_factory=list)
    nbytes: int = 0
    seconds: float = 0.0
    remote_calls: list[RemoteCall] = field(default_factory=list)
    ranks: int = 1  # how many ranks' outcomes are merged in (asynchronous loads report apart)
    cancelled: bool = False  # an asynchronous load abandoned because its request finished
    rank_disagreements: int = 0  # merges of ranks' outcomes that listed different chunks

    @property
    def failed(self) -> bool:
        return bool(self.failed_block_ids)

    def tokens_by_tier(self) -> dict[str, int]:
        by_tier: dict[str, int] = {}
        for c in self.chunks:
            if c.tier is not None:
                by_tier[c.tier] = by_tier.get(c.tier, 0) + c.num_tokens
        return by_tier

    def failures(self) -> list[ChunkLoadResult]:
        return [c for c in self.chunks if c.reason is not None]

    def merge(self, other: LoadOutcome) -> bool:
        """Chunk by chunk: loaded only if every rank loaded it; a rank's fallback tier wins.

        Never raises (it runs inside vLLM's aggregation of the workers' outputs). Ranks that
        disagree on the chunks (a rank that abandoned its load before it started) are logged
        and counted (``rank_disagreements``): a chunk a rank does not list is not loaded there.
        Returns whether they disagreed."""
        disagree = [c.name for c in self.chunks] != [c.name for c in other.chunks]
        if disagree:
            logger.warning(
                "KVLens: ranks disagree on the chunks of %s's load (%d and %d); a chunk one rank "
                "does not list counts as not loaded",
                self.request_id,
                len(self.chunks),
                len(other.chunks),
            )
        theirs_by_name = {c.name: c for c in other.chunks}
        for mine in self.chunks:
            theirs = theirs_by_name.pop(mine.name, None)
            if theirs is None:  # not listed there: not loaded there
                mine.tier = None
                continue
            if mine.reason is None and theirs.reason is not None:
                mine.reason, mine.detail = theirs.reason, theirs.detail  # its planned copy failed somewhere
            if mine.ok and not theirs.ok:
                mine.tier = None
            elif mine.ok and theirs.ok and mine.tier == mine.planned_tier:
                mine.tier = theirs.tier
        for theirs in theirs_by_name.values():  # listed there only: not loaded here
            self.chunks.append(
                ChunkLoadResult(
                    theirs.name, theirs.planned_tier, theirs.num_tokens, None, theirs.reason, theirs.detail
                )
            )
        self.failed_block_ids = sorted(set(self.failed_block_ids) | set(other.failed_block_ids))
        self.nbytes += other.nbytes
        self.seconds = max(self.seconds, other.seconds)
        self.remote_calls.extend(other.remote_calls)
        self.ranks += other.ranks
        self.cancelled = self.cancelled or other.cancelled
        self.rank_disagreements += other.rank_disagreements + disagree
        return disagree

    @classmethod
    def not_started(cls, request_id: str, chunks: Iterable[Any]) -> LoadOutcome:
        """A load abandoned before it read anything (``chunks``: its ``ChunkLoad``s): every
        chunk listed, none loaded, so that every rank's outcome lists the same chunks."""
        return cls(request_id, [ChunkLoadResult(c.name, c.tier, c.num_tokens) for c in chunks])


@dataclass(frozen=True, slots=True)
class StoreFailure:
    """A planned store that did not land in a tier (on at least one rank)."""

    request_id: str
    name: str
    tier: str
    reason: FailureReason
    detail: str = ""


@dataclass(frozen=True, slots=True)
class KeptChunk:
    """An eviction the tier declined: another engine used the chunk within the grace period."""

    tier: str
    name: str
    nbytes: int


class Stage(str, Enum):
    """Where a chunk's bytes move, each stage timed where it runs."""

    GATHER = "gather"  # vLLM's KV cache -> a host buffer, for a store (the CPU tier keeps that buffer)
    WRITE = "write"  # the buffer -> a disk or remote tier, on its background writer
    READ = "read"  # a disk or remote tier -> host memory, for a load (the CPU tier is read in place)
    COPY = "copy"  # host memory -> vLLM's KV cache


@dataclass(slots=True)
class Moved:
    nbytes: int = 0
    seconds: float = 0.0  # rank-seconds: overlapping reads of one tier count once


@dataclass(slots=True)
class TierTraffic:
    """One tier's stores that became durable and the bytes that moved for it since the last
    report (summed over ranks when merged)."""

    stored_chunks: int = 0  # writes the tier holds now (rank 0's, so a chunk counts once)
    stored_tokens: int = 0  # rank 0's
    stored_bytes: int = 0  # every rank's share
    moved: dict[Stage, Moved] = field(default_factory=dict)

    def add_stored(self, chunks: int, tokens: int, nbytes: int) -> None:
        self.stored_chunks += chunks
        self.stored_tokens += tokens
        self.stored_bytes += nbytes

    def add_moved(self, stage: Stage, nbytes: int, seconds: float) -> None:
        moved = self.moved.setdefault(stage, Moved())
        moved.nbytes += nbytes
        moved.seconds += seconds

    def is_empty(self) -> bool:
        return not (self.stored_chunks or self.stored_bytes or self.moved)

    def merge(self, other: TierTraffic) -> None:
        self.add_stored(other.stored_chunks, other.stored_tokens, other.stored_bytes)
        for stage, moved in other.moved.items():
            self.add_moved(stage, moved.nbytes, moved.seconds)


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


@dataclass(slots=True)
class WorkerReport:
    """Workers to scheduler, once per step, merged across ranks."""

    loads: dict[str, LoadOutcome] = field(default_factory=dict)
    store_failures: list[StoreFailure] = field(default_factory=list)
    kept: list[KeptChunk] = field(default_factory=list)
    deleted: list[tuple[str, str]] = field(default_factory=list)  # (tier, chunk) whose file rank 0 removed
    tier_states: dict[str, TierState] = field(default_factory=dict)  # changes (worst rank wins)
    # queued background writes on the busiest rank; None: unchanged since the last report
    pending_writes: int | None = None
    step: int | None = None  # the step whose loads this report settles (None: it had none)
    traffic: dict[str, TierTraffic] = field(default_factory=dict)  # by tier
    blends: dict[str, BlendOutcome] = field(default_factory=dict)  # by request (blend_jobs)

    def tier_traffic(self, tier: str) -> TierTraffic:
        traffic = self.traffic.get(tier)
        if traffic is None:
            traffic = self.traffic[tier] = TierTraffic()
        return traffic

    def is_empty(self) -> bool:
        return not (
            self.loads
            or self.traffic
            or self.store_failures
            or self.kept
            or self.deleted
            or self.tier_states
            or self.pending_writes is not None
            or self.step is not None
            or self.blends
        )

    def merge(self, other: WorkerReport) -> WorkerReport:
        for rid, outcome in other.loads.items():
            if rid in self.loads:
                self.loads[rid].merge(outcome)
            else:
                self.loads[rid] = outcome
        self.store_failures.extend(f for f in other.store_failures if f not in self.store_failures)
        self.kept.extend(k for k in other.kept if k not in self.kept)
        self.deleted.extend(other.deleted)
        for tier, state in other.tier_states.items():
            mine = self.tier_states.get(tier)
            if mine is None or state.level < mine.level:
                self.tier_states[tier] = state
        for tier, traffic in other.traffic.items():
            self.tier_traffic(tier).merge(traffic)
        if other.pending_writes is not None:
            self.pending_writes = max(self.pending_writes or 0, other.pending_writes)
        if other.step is not None:
            self.step = other.step if self.step is None else min(self.step, other.step)
        for rid, blend in other.blends.items():
            if rid in self.blends:
                self.blends[rid].merge(blend)
            else:
                self.blends[rid] = blend
        return self


@dataclass(frozen=True, slots=True)
class RequestSummary:
    """What KVLens did for one finished request (the request log's line; no tokens, no text)."""

    request_id: str
    prompt_tokens: int
    vllm_cached_tokens: int
    loaded_tokens: Mapping[str, int]  # tier -> tokens KVLens loaded
    miss_reason: MissReason | None
    miss_detail: Mapping[str, object] | None
    load_seconds: float | None  # None: nothing was loaded
    stored_chunks: int
    failed_blocks: int
    failure_reasons: tuple[str, ...]
    trace_context: Mapping[str, str] | None
    blend: Mapping[str, object] | None = None  # its response's kvlens.blend (None: it did not blend)
