"""The worker half: carries out the scheduler's plan against this rank's KV tensors.

Per step: loads (before attention needs them), then evictions and stores once the step's
KV exists. Nothing here raises into vLLM for a bad chunk or a failing store: a failed load
becomes failed block ids (vLLM recomputes them) and a report the scheduler uses to drop
the chunk from its index.
"""

from __future__ import annotations

import logging
import time

import torch

from .config import ConfigError, KVLensConfig
from .engine.facts import EngineFacts
from .engine.jobs import (
    CPU,
    DISK,
    ChunkLoad,
    LoadJob,
    LoadOutcome,
    StepPlan,
    StoreJob,
    WorkerReport,
)
from .engine.keys import storage_name
from .kv_blocks import BlockCopier
from .tiers import disk as disk_files
from .tiers.background import BackgroundWrites
from .tiers.base import ChunkCorrupt, ChunkMissing, Tier
from .tiers.cpu import CpuTier
from .tiers.disk import DiskTier

logger = logging.getLogger("vllm.kvlens")

_LOAD_ERRORS = (ChunkMissing, ChunkCorrupt, OSError, ValueError, RuntimeError)


class ConnectorWorker:
    def __init__(self, config: KVLensConfig, facts: EngineFacts, rank: int) -> None:
        config.check_block_size(facts.block_size)
        self.config = config
        self.facts = facts
        self.rank = rank
        self.tiers: dict[str, Tier] = {}
        self._background: list[BackgroundWrites] = []  # tiers whose writes run off the step loop
        if config.local_cpu:
            self.tiers[CPU] = CpuTier()
        if config.local_disk:
            try:
                disk = BackgroundWrites(DiskTier(config.local_disk, facts.kv_layout))
            except OSError as e:
                raise ConfigError(f"KVLens config key 'local_disk' = {config.local_disk!r}: {e}") from e
            disk_files.sweep_temp_files(config.local_disk)
            self.tiers[DISK] = disk
            self._background.append(disk)
        self.copier: BlockCopier | None = None
        self._failed_blocks: set[int] = set()
        self._report = WorkerReport()

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        copier = BlockCopier(kv_caches, num_blocks)
        if copier.block_bytes != self.facts.block_bytes or copier.num_layers != self.facts.num_layers:
            raise ValueError(
                f"KVLens: KV tensors hold {copier.num_layers} layers x {copier.block_bytes} bytes "
                f"per block; the scheduler planned {self.facts.num_layers} x {self.facts.block_bytes}"
            )
        self.copier = copier

    # ---- loads --------------------------------------------------------------------------
    def load(self, plan: StepPlan) -> list[LoadOutcome]:
        """Runs the step's load jobs in order; their outcomes, in the same order."""
        outcomes = []
        for job in plan.loads:
            outcome = self._load_job(job)
            self._report.loads[job.request_id] = outcome
            self._failed_blocks.update(outcome.failed_block_ids)
            outcomes.append(outcome)
        return outcomes

    def _load_job(self, job: LoadJob) -> LoadOutcome:
        started = time.perf_counter()
        outcome = LoadOutcome()
        failed = False
        for chunk in job.chunks:
            if failed:  # later chunks are recomputed anyway; don't spend time loading them
                outcome.failed_block_ids.extend(chunk.block_ids)
                continue
            tier = self._load_chunk(chunk, outcome)
            if tier is None:
                failed = True
                outcome.failed_block_ids.extend(chunk.block_ids)
            else:
                outcome.tokens_by_tier[tier] = outcome.tokens_by_tier.get(tier, 0) + chunk.num_tokens
        outcome.seconds = time.perf_counter() - started
        if failed:
            logger.warning(
                "KVLens: request %s: load failed for %d blocks (%s); vLLM recomputes them",
                job.request_id,
                len(outcome.failed_block_ids),
                "; ".join(reason for _, _, reason in outcome.failed_chunks),
            )
        return outcome

    def _load_chunk(self, chunk: ChunkLoad, outcome: LoadOutcome) -> str | None:
        """Copy one chunk's blocks in, from its tier or, failing that, any other; the tier used."""
        assert self.copier is not None
        name = storage_name(chunk.name, self.rank)
        order = [chunk.tier] + [t for t in self.tiers if t != chunk.tier]
        for tier_name in order:
            tier = self.tiers.get(tier_name)
            if tier is None:
                continue
            try:
                payload = self.copier.payload_view(tier.get(name))
                self.copier.scatter(payload, chunk.block_ids, chunk.first_block)
            except _LOAD_ERRORS as e:
                if tier_name == chunk.tier or not isinstance(e, ChunkMissing):
                    outcome.failed_chunks.append((chunk.name, tier_name, _reason(e)))
                continue
            outcome.nbytes += len(chunk.block_ids) * self.copier.block_bytes * self.copier.num_layers
            return tier_name
        return None

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # ---- stores -------------------------------------------------------------------------
    def save(self, plan: StepPlan) -> list[tuple[str, str, str]]:
        """Evicts, then stores; returns this step's failed writes (name, tier, reason)."""
        failures_before = len(self._report.store_failures)
        for eviction in plan.evictions:
            tier = self.tiers.get(eviction.tier)
            if tier is not None:
                try:
                    tier.delete(storage_name(eviction.name, self.rank))
                except OSError as e:
                    logger.warning(
                        "KVLens: evicting %s from %s failed: %s", eviction.name[:12], eviction.tier, e
                    )
        for job in plan.stores:
            self._store(job)
        return self._report.store_failures[failures_before:]

    def _store(self, job: StoreJob) -> None:
        assert self.copier is not None
        name = storage_name(job.name, self.rank)
        try:
            data = self.copier.gather(job.block_ids)
        except (RuntimeError, ValueError) as e:
            self._report.store_failures.extend((job.name, t, _reason(e)) for t in job.tiers)
            return
        payload = memoryview(data.numpy()).cast("B")
        for tier_name in job.tiers:
            tier = self.tiers.get(tier_name)
            if tier is None:
                continue
            try:
                tier.put(name, payload)
            except OSError as e:
                logger.warning("KVLens: storing %s in %s failed: %s", job.name[:12], tier_name, e)
                self._report.store_failures.append((job.name, tier_name, _reason(e)))

    def take_report(self) -> WorkerReport | None:
        suffix = storage_name("", self.rank)
        for tier in self._background:
            self._report.store_failures.extend(
                (name.removesuffix(suffix), tier.name, reason) for name, reason in tier.take_failures()
            )
        if self._report.is_empty():
            return None
        report, self._report = self._report, WorkerReport()
        return report

    def sizes(self) -> dict[str, int]:
        """Internal sizes, for leak-spotting gauges."""
        pending = sum(t.pending for t in self._background)
        return {"invalid_block_ids": len(self._failed_blocks), "pending_writes": pending}

    def flush(self) -> None:
        """Wait for every queued background write and delete."""
        for tier in self._background:
            tier.flush()

    def shutdown(self) -> None:
        for tier in self._background:
            tier.close()


def _reason(error: BaseException) -> str:
    kind = {ChunkMissing: "missing", ChunkCorrupt: "corrupt"}.get(type(error), type(error).__name__)
    return f"{kind}: {error}" if str(error) else kind
