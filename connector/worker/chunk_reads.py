"""A load job's reads: each chunk from its planned tier (the slow tiers read ahead, disk layer by
layer), checked, or from another usable tier; the copies to make for the usable ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from ..engine.jobs import REMOTE, ChunkLoad, LoadJob
from ..engine.keys import storage_name
from ..engine.outcomes import ChunkLoadResult, FailureReason, LoadOutcome, StoreFailure
from ..tiers.background import BackgroundTier, QueueFull
from ..tiers.base import classify
from ..tiers.disk_layers import LayeredRecord
from .kv_blocks import CopyPairs
from .layer_copies import BlockLoad, CopyStalled
from .payload_pool import ViewLease
from .read_jobs import NO_PAYLOAD, Opened, Read, ReadJob, Staged, read_safely, run_or_defer
from .worker_state import WorkerState
from .writes import Writes

logger = logging.getLogger("vllm.kvlens")


class ChunkReads:
    """Reads and checks load jobs' chunks, on the step thread or the asynchronous-load thread."""

    def __init__(self, state: WorkerState, writes: Writes) -> None:
        self.state = state
        self.writes = writes  # promotions into the faster tiers

    def read_job(self, job: LoadJob, effects: list[Callable[[], None]] | None = None) -> ReadJob:
        """Reads and checks a job's chunks; the copies to make for the ones that are usable.

        ``effects``: off the step thread, what changes the step's state (promotions into
        faster tiers, the report's store failures) is appended there to run on it later."""
        return read_safely(job, lambda opened: self._read_chunks(job, opened, effects))

    def _read_chunks(self, job: LoadJob, opened: Opened, effects: list[Callable[[], None]] | None) -> ReadJob:
        outcome = LoadOutcome(job.request_id)
        started = time.perf_counter()
        staged: list[Staged] = []
        lease = self.state.pool.lease()  # the CPU-tier views it reads: not reused before it is closed
        opened.append(lease)
        reads = self._start_reads(job, opened, lease)
        failed = False
        for chunk in job.chunks:
            result = ChunkLoadResult(chunk.name, chunk.tier, chunk.num_tokens)
            outcome.chunks.append(result)
            if failed:  # recomputed anyway, and no longer trusted as part of this prefix
                result.reason = FailureReason.PREFIX_FAILED
            else:
                load = self._read_chunk(chunk, next(reads[chunk.tier]), result, lease, effects)
                if load is not None:
                    outcome.nbytes += self.payload_bytes(chunk)
                    staged.append((result, load, chunk))
                failed = not result.ok
            if not result.ok:
                outcome.failed_block_ids.extend(chunk.block_ids)
                for tier_name in chunk.promote_to:  # admitted for a copy that never came
                    failure = StoreFailure(
                        job.request_id, chunk.name, tier_name, result.reason or FailureReason.IO_ERROR
                    )
                    run_or_defer(effects, lambda f=failure: self.state.report.store_failures.append(f))
        remote = self.state.tiers.get(REMOTE)
        if isinstance(remote, BackgroundTier):
            while remote.reads:
                outcome.remote_calls.append(remote.reads.popleft())
        outcome.seconds = time.perf_counter() - started  # the copies' time is added when done
        return job, outcome, staged, opened

    def fail_from(
        self,
        outcome: LoadOutcome,
        staged: list[Staged],
        error: BaseException,
        effects: list[Callable[[], None]] | None = None,
    ) -> None:
        """A copy (or the read of a layer) raised: that chunk and every later one of the request
        are recomputed; a promotion that waited for them is reported failed (never made)."""
        reason, detail = classify(error)
        for i, (result, load, chunk) in enumerate(staged):
            result.tier = None
            result.reason, result.detail = (reason, detail) if i == 0 else (FailureReason.PREFIX_FAILED, "")
            outcome.nbytes -= self.payload_bytes(chunk)
            outcome.failed_block_ids.extend(chunk.block_ids)
            if load.promote is not None:
                load.promote = None
                for tier_name in chunk.promote_to:
                    failure = StoreFailure(outcome.request_id, chunk.name, tier_name, result.reason)
                    run_or_defer(effects, lambda f=failure: self.state.report.store_failures.append(f))

    def layer_failed(self, tier_name: str | None, error: BaseException) -> None:
        """A chunk's read failed after its header was good (a layer's checksum or read)."""
        if tier_name in self.state.health and not isinstance(error, CopyStalled):
            self.state.health[tier_name].failed(*classify(error))

    def payload_bytes(self, chunk: ChunkLoad) -> int:
        return len(chunk.block_ids) * self.state.facts.block_bytes * self.state.facts.num_layers

    @staticmethod
    def log_failed_load(job: LoadJob, outcome: LoadOutcome) -> None:
        first = next(c for c in outcome.chunks if not c.ok)
        logger.warning(
            "KVLens: request %s: load failed for %d blocks (%s in %s: %s); vLLM recomputes them",
            job.request_id,
            len(outcome.failed_block_ids),
            first.reason.value if first.reason else "error",
            first.planned_tier,
            first.detail,
        )

    def _start_reads(self, job: LoadJob, opened: Opened, lease: ViewLease) -> dict[str, Iterator[Read]]:
        """Per planned tier, the reads of its chunks in job order (slow tiers read ahead);
        layer-wise disk reads started are added to ``opened``."""
        by_tier: dict[str, list[ChunkLoad]] = {}
        for chunk in job.chunks:
            by_tier.setdefault(chunk.tier, []).append(chunk)
        return {tier: self._read_many(tier, chunks, opened, lease) for tier, chunks in by_tier.items()}

    def _read_many(
        self, tier_name: str, chunks: list[ChunkLoad], opened: Opened, lease: ViewLease
    ) -> Iterator[Read]:
        tier, health = self.state.tiers.get(tier_name), self.state.health.get(tier_name)
        names = [storage_name(chunk.name, self.state.rank) for chunk in chunks]
        if tier is None or health is None or not health.usable():
            return iter([ConnectionAbortedError(f"{tier_name} tier is skipped")] * len(names))
        if isinstance(tier, BackgroundTier) and tier.layered and self.state.copier is not None:
            # layer 0 of each first; a whole chunk nobody promotes goes straight into its blocks
            targets = [
                None
                if chunk.promote_to or chunk.first_block
                else self.state.copier.load_targets(chunk.block_ids)
                for chunk in chunks
            ]
            reads = tier.get_layered(names, self.state.copier.num_layers, targets)
            opened.append(reads)
            return (reads.record(i) for i in range(len(names)))
        if isinstance(tier, BackgroundTier):
            return tier.get_many(names)
        return (lease.read(tier, name) for name in names)

    def _read_chunk(
        self,
        chunk: ChunkLoad,
        first_read: Read,
        result: ChunkLoadResult,
        lease: ViewLease,
        effects: list[Callable[[], None]] | None = None,
    ) -> BlockLoad | None:
        """One chunk's copy to make, from its tier or, failing that, another usable tier."""
        assert self.state.copier is not None
        name = storage_name(chunk.name, self.state.rank)
        source = first_read if isinstance(first_read, LayeredRecord) else None
        read = first_read.payload() if isinstance(first_read, LayeredRecord) else first_read
        for tier_name in [chunk.tier] + [t for t in self.state.tiers if t != chunk.tier]:
            if tier_name != chunk.tier:
                if not self.state.health[tier_name].usable():
                    continue
                source, read = None, lease.read(self.state.tiers[tier_name], name)
            if read is None and source is not None:  # its layers are read straight into its blocks
                result.tier = tier_name
                self.state.health[tier_name].succeeded()
                nothing_to_copy: CopyPairs = [[] for _ in range(self.state.copier.num_layers)]
                return BlockLoad(NO_PAYLOAD, chunk.block_ids, chunk.first_block, nothing_to_copy, source)
            error: BaseException | None = read if isinstance(read, BaseException) else None
            if error is None:
                try:
                    payload = self.state.copier.payload_view(read)  # type: ignore[arg-type]
                    self.state.copier.check_payload(payload, len(chunk.block_ids), chunk.first_block)
                except ValueError as e:
                    error = e
            if error is None:
                result.tier = tier_name
                self.state.health[tier_name].succeeded()
                promote = None
                if chunk.promote_to:  # once every layer is read and checked, and copied
                    promote = lambda read=read: self._promote(chunk, name, read)  # type: ignore[misc]  # noqa: E731
                    if source is None:
                        run_or_defer(effects, promote)
                        promote = None
                pairs = (
                    None
                    if self.state.runner is None and effects is None and source is None
                    else self.state.copier.load_pairs(payload, chunk.block_ids, chunk.first_block)
                )
                return BlockLoad(payload, chunk.block_ids, chunk.first_block, pairs, source, promote)
            reason, detail = classify(error)
            if isinstance(error, ConnectionAbortedError):
                reason = FailureReason.TIER_UNHEALTHY
            self.state.health[tier_name].failed(reason, detail)
            if tier_name == chunk.tier:
                result.reason, result.detail = reason, detail
        return None

    def _promote(self, chunk: ChunkLoad, name: str, payload: memoryview) -> None:
        """Keep a chunk read from a slower tier in the faster ones the scheduler admitted it to."""
        for tier_name in chunk.promote_to:
            if tier_name in self.state.tiers:
                try:
                    self.writes.put(tier_name, name, payload, "", chunk.num_tokens)
                except (OSError, QueueFull) as e:
                    reason, detail = classify(e)
                    self.state.report.store_failures.append(
                        StoreFailure("", chunk.name, tier_name, reason, detail)
                    )
