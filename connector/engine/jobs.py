"""The per-step plan the scheduler sends to the workers (picklable, no torch)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .blend_jobs import BlendJob

CPU = "cpu"
DISK = "disk"
REMOTE = "remote"
TIER_ORDER = (CPU, DISK, REMOTE)  # fastest first: a lookup and a load prefer the earlier tier


@dataclass(frozen=True, slots=True)
class ChunkLoad:
    name: str  # chunk digest (hex); workers add their rank
    tier: str
    block_ids: tuple[int, ...]  # vLLM blocks to write, in order
    first_block: int  # index, within the stored chunk, of the block written to block_ids[0]
    num_tokens: int  # tokens these blocks make valid for the request
    promote_to: tuple[str, ...] = ()  # faster tiers to keep the whole chunk in once it is read


@dataclass(frozen=True, slots=True)
class LoadJob:
    request_id: str
    chunks: tuple[ChunkLoad, ...]
    trace_context: Mapping[str, str] | None = None
    # Blocks vLLM allocated for tokens this job cannot supply: reported failed with its outcome
    # (asynchronous loads; a step's plan carries them in ``fail_blocks``).
    fail_blocks: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class StoreJob:
    request_id: str
    name: str
    block_ids: tuple[int, ...]  # every block of the chunk, in order
    tiers: tuple[str, ...]
    num_tokens: int
    # Blocks this chunk's KV was computed over that were loaded in this step or in an earlier
    # one whose report the scheduler had not processed when it planned this store (vLLM's
    # asynchronous scheduling plans a step before the last one's output arrives): if any of
    # them failed to load, the chunk's KV is wrong and the store is withdrawn.
    after_loads: tuple[int, ...] = ()
    trace_context: Mapping[str, str] | None = None
    namespace: str = ""  # key fingerprint of the request's namespace, written into disk/remote records
    # Tensor parallelism: the step whose merged report settles ``after_loads`` on every rank;
    # the store is gathered in its step and held until a plan's ``reported_through`` reaches
    # this, then written unless that plan (or an earlier one) lists it ``withdrawn``. -1: no wait.
    settled_by: int = -1


@dataclass(frozen=True, slots=True)
class Eviction:
    tier: str
    name: str


@dataclass(slots=True)
class StepPlan:
    """What the workers do in one engine step.

    Loads run before the forward pass. ``writes`` (evictions and stores) run after it, in
    the order the scheduler decided them, so each tier ends the step holding exactly what
    the scheduler's index says. ``fail_blocks`` are blocks vLLM allocated for tokens KVLens
    will not load: workers report them as failed so vLLM recomputes them.
    """

    loads: list[LoadJob] = field(default_factory=list)
    writes: list[StoreJob | Eviction] = field(default_factory=list)
    fail_blocks: list[int] = field(default_factory=list)
    drain: bool = False  # no request is running: let background writes finish and report
    idle: bool = False  # nothing computes in this step (vLLM steps while requests wait for KV)
    # Loads that run outside the step (vLLM's asynchronous loads: the request waits in
    # WAITING_FOR_REMOTE_KVS) and requests whose asynchronous load is abandoned (aborted).
    async_loads: list[LoadJob] = field(default_factory=list)
    cancel_async: list[str] = field(default_factory=list)
    step: int = 0  # the scheduler's step number (plans are numbered in the order built)
    # The newest step whose report the scheduler had processed when it built this plan: no
    # later store depends on loads of that step or before (workers forget their failures).
    reported_through: int = -1
    # (plan step, chunk) of held stores (``StoreJob.settled_by``) computed over a block whose
    # load failed on some rank: never written, on any rank.
    withdrawn: list[tuple[int, str]] = field(default_factory=list)
    # Requests blended before the forward pass (``blend_jobs``), after the loads.
    blends: list[BlendJob] = field(default_factory=list)

    @property
    def awaits_report(self) -> bool:
        """The scheduler needs this step's report to know what its loads left behind."""
        return bool(self.loads or self.fail_blocks or self.blends)

    @property
    def stores(self) -> list[StoreJob]:
        return [w for w in self.writes if isinstance(w, StoreJob)]

    @property
    def evictions(self) -> list[Eviction]:
        return [w for w in self.writes if isinstance(w, Eviction)]
