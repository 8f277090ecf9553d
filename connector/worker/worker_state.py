"""What one rank's worker parts share: its tiers and their health, the buffers the CPU tier
dropped, the KV tensors' copier, the copy runner, the report being built, and the steps whose
writes wait for their copies.
"""

from __future__ import annotations

import logging
from collections import deque

from ..config.loading import ConfigError, KVLensConfig
from ..engine import cpu_budget
from ..engine.facts import EngineFacts
from ..engine.health import TierHealth
from ..engine.jobs import CPU, DISK, REMOTE
from ..engine.outcomes import WorkerReport
from ..engine.segment_records import PREFIX_BYTES
from ..tiers import disk as disk_files
from ..tiers.background import BackgroundTier
from ..tiers.base import Tier
from ..tiers.cpu import CpuTier
from ..tiers.disk import DiskTier
from ..tiers.record_trust import RecordTrust
from ..tiers.redis_tier import RedisTier
from .kv_blocks import BlockCopier
from .layer_copies import CopyRunner, StepCopies
from .payload_pool import PayloadPool
from .store_dependencies import StepWrites, StoreDependencies
from .tail_slots import TailSlots

logger = logging.getLogger("vllm.kvlens")


class WorkerState:
    """The state the worker's parts (reads, writes, loads outside the step, reports) work on;
    ``ConnectorWorker`` is one, and hands itself to each part."""

    def __init__(self, config: KVLensConfig, facts: EngineFacts, rank: int) -> None:
        config.check_block_size(facts.block_size)
        self.config = config
        self.facts = facts
        self.rank = rank
        self.counts_chunks = 1 if rank == 0 else 0  # chunks and tokens count once, on rank 0
        self.tiers: dict[str, Tier | BackgroundTier] = {}
        self.health: dict[str, TierHealth] = {}
        self.background: list[BackgroundTier] = []
        extra = config.extra_config
        # buffers the CPU tier dropped, kept for the next stores' gathers (within its budget)
        budget = config.cpu_budget_bytes
        self.pool = PayloadPool(lambda: cpu_budget.reusable_bytes(budget, self.cpu_used()))
        largest = facts.chunk_nbytes(config.chunk_size) + (PREFIX_BYTES if config.enable_blending else 0)
        trust = RecordTrust.of(config.store_auth_key, largest)  # a segment chunk: its 16-byte prefix more
        if config.local_cpu:
            self.tiers[CPU] = CpuTier(self.pool.dropped)
            self.health[CPU] = TierHealth(CPU)
        if config.local_disk:
            self.health[DISK] = TierHealth(DISK)
            try:
                disk = DiskTier(
                    config.local_disk,
                    facts.kv_layout,
                    extra.disk_shared_grace_s,
                    remove_corrupt=facts.stores,
                    layers=facts.num_layers,
                    trust=trust,
                )
            except OSError as e:
                raise ConfigError(f"KVLens config key 'local_disk' = {config.local_disk!r}: {e}") from e
            disk_files.sweep_temp_files(config.local_disk)
            background = BackgroundTier(
                disk, self.health[DISK], extra.tier_timeout_s, extra.max_pending_write_bytes
            )
            self.tiers[DISK] = background
            self.background.append(background)
        if config.remote is not None:
            self.health[REMOTE] = TierHealth(REMOTE)
            client = RedisTier(
                config.remote,
                facts.kv_layout,
                extra.remote_key_prefix,
                extra.remote_ttl_s,
                extra.remote_timeout_s,
                min(extra.remote_timeout_s, 1.0),
                trust=trust,
            )
            remote = BackgroundTier(
                client, self.health[REMOTE], extra.tier_timeout_s, extra.max_pending_write_bytes
            )
            connect_at_start_up(client, self.health[REMOTE])
            self.tiers[REMOTE] = remote
            self.background.append(remote)
        self.copier: BlockCopier | None = None
        # which bytes of a block are which token's: unknown (unfull chunks stay in) until probed
        self.tail_slots = TailSlots(facts.block_size)
        self.failed_blocks: set[int] = set()  # to hand to vLLM this step
        self.step_failed: set[int] = set()  # blocks that failed to load in the current step
        self.deps = StoreDependencies()  # stores over failed loads: withdrawn, or held for the report
        self.report = WorkerReport()
        # where copies run beside the forward pass: a thread on CPU (with use_layerwise), a
        # stream of KVLens's own on CUDA; None: inline, in the step
        self.runner: CopyRunner | None = None
        self.unwritten: deque[StepWrites] = deque()  # steps whose writes wait for their copies

    def retire_if_stalled(self, step: StepCopies) -> None:
        """After the copy thread died or stalled, later steps copy in the step, on this thread
        (a device's stream is kept: copying in the step would wait on the same device)."""
        if step.stalled is None or self.runner is None:
            return
        if not self.runner.copies_on_host:
            logger.error("KVLens: %s; this step's unfinished stores are dropped", step.stalled)
            return
        logger.error(
            "KVLens: %s; this step's unfinished loads are recomputed and its stores dropped, "
            "and copies run in the step from now on",
            step.stalled,
        )
        self.runner.close(0.0)
        self.runner = None

    def cpu_used(self) -> int:
        cpu = self.tiers.get(CPU)
        return cpu.used_bytes if isinstance(cpu, CpuTier) else 0


def connect_at_start_up(client: RedisTier, health: TierHealth) -> None:
    """Open the client's connections now (within its own timeouts), not in the first load or
    store; one that cannot be opened marks the tier skipped for the probes to bring back."""
    try:
        client.connect()
    except OSError as e:
        health.skip(f"not reachable at start-up ({e}); probing in the background")
