"""The worker half: carries out the scheduler's plan against this rank's KV tensors.

Per step: loads before the forward pass, then the plan's evictions and stores in the order
the scheduler decided them. Nothing here raises into vLLM for a bad chunk or a failing tier:
a failed load becomes failed block ids (vLLM recomputes them); a store whose KV was computed
over a block that failed to load in this step is withdrawn, never written; every failure goes
back to the scheduler in the step's report, so its index keeps agreeing with the tiers.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator

import torch

from ..config.loading import ConfigError, KVLensConfig
from ..engine import cpu_budget
from ..engine.facts import EngineFacts
from ..engine.health import TierHealth
from ..engine.jobs import CPU, DISK, REMOTE, ChunkLoad, Eviction, LoadJob, StepPlan, StoreJob
from ..engine.keys import storage_name
from ..engine.outcomes import (
    ChunkLoadResult,
    FailureReason,
    KeptChunk,
    LoadOutcome,
    RemoteCall,
    Stage,
    StoreFailure,
    TierState,
    TierTraffic,
    WorkerReport,
)
from ..engine.snapshots import WorkerSizes
from ..tiers import disk as disk_files
from ..tiers.background import BackgroundTier, QueueFull
from ..tiers.base import Tier, classify
from ..tiers.cpu import CpuTier
from ..tiers.disk import DiskTier
from ..tiers.disk_layers import LayeredRecord
from ..tiers.record_trust import RecordTrust
from ..tiers.redis_tier import RedisTier
from .async_loads import AsyncLoader
from .cuda_copies import CudaCopyStream, TorchCuda
from .kv_blocks import BlockCopier, CopyPairs
from .layer_copies import (
    BlockGather,
    BlockLoad,
    CopyRunner,
    CopyStalled,
    CopyThread,
    StepCopies,
    copy_load_layer,
)
from .payload_pool import PayloadPool, ViewLease
from .read_jobs import (
    NO_PAYLOAD,
    Opened,
    Read,
    ReadJob,
    Staged,
    close_reads,
    copy_seconds,
    read_safely,
    run_or_defer,
)
from .store_dependencies import StepWrites, StoreDependencies

logger = logging.getLogger("vllm.kvlens")

DRAIN_WAIT_S = 0.05  # an idle engine's empty step waits this long for background writes
IDLE_WAIT_S = 0.01  # a step that computed nothing waits this long for an asynchronous load


class ConnectorWorker:
    def __init__(self, config: KVLensConfig, facts: EngineFacts, rank: int) -> None:
        config.check_block_size(facts.block_size)
        self.config = config
        self.facts = facts
        self.rank = rank
        self._counts_chunks = 1 if rank == 0 else 0  # chunks and tokens count once, on rank 0
        self.tiers: dict[str, Tier | BackgroundTier] = {}
        self.health: dict[str, TierHealth] = {}
        self._background: list[BackgroundTier] = []
        extra = config.extra_config
        # buffers the CPU tier dropped, kept for the next stores' gathers (within its budget)
        budget = config.cpu_budget_bytes
        self._pool = PayloadPool(lambda: cpu_budget.reusable_bytes(budget, self._cpu_used()))
        trust = RecordTrust.of(config.store_auth_key, facts.chunk_nbytes(config.chunk_size))
        if config.local_cpu:
            self.tiers[CPU] = CpuTier(self._pool.dropped)
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
            self._background.append(background)
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
            self.tiers[REMOTE] = remote
            self._background.append(remote)
        self.copier: BlockCopier | None = None
        self._failed_blocks: set[int] = set()  # to hand to vLLM this step
        self._step_failed: set[int] = set()  # blocks that failed to load in the current step
        self._deps = StoreDependencies()  # stores over failed loads: withdrawn, or held for the report
        self._report = WorkerReport()
        self._reported_pending = 0  # the pending-write count the scheduler last heard
        self._suffix = storage_name("", rank)
        # where copies run beside the forward pass: a thread on CPU (with use_layerwise), a
        # stream of KVLens's own on CUDA; None: inline, in the step
        self._runner: CopyRunner | None = None
        self._step: StepCopies | None = None  # this step's copies, from its first hook to save()
        self._unwritten: deque[StepWrites] = deque()  # steps whose writes wait for their copies
        self._loading: list[ReadJob] = []  # this step's load jobs, from start_load to finish_load
        self._async: AsyncLoader | None = None  # loads outside the step, started on first use

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        copier = BlockCopier(kv_caches, num_blocks)
        if copier.block_bytes != self.facts.block_bytes or copier.num_layers != self.facts.num_layers:
            raise ValueError(
                f"KVLens: KV tensors hold {copier.num_layers} layers x {copier.block_bytes} bytes "
                f"per block; the scheduler planned {self.facts.num_layers} x {self.facts.block_bytes}"
            )
        self.copier = copier
        if self._runner is None and copier.device.type == "cuda":
            self._runner = CudaCopyStream(TorchCuda(copier.device))
        elif self._runner is None and self.config.use_layerwise and copier.device.type == "cpu":
            self._runner = CopyThread()

    # ---- loads --------------------------------------------------------------------------
    def load(self, plan: StepPlan) -> list[LoadOutcome]:
        """Runs the step's load jobs to the end; their outcomes, in job order."""
        self.start_load(plan)
        return self.finish_load()

    def start_load(self, plan: StepPlan, layer_hooks: bool = True) -> None:
        """Reads every chunk the step loads and starts copying them in, layer by layer.

        Which chunks fail (missing, corrupt, a tier down) is known when this returns; the
        copies run beside the forward pass (``wait_layer``) and are done after ``finish_load``.
        ``layer_hooks=False``: vLLM will not call ``wait_layer`` in this step (a full CUDA
        graph), so the forward pass comes after every load.
        """
        self._write_before(plan)
        self._step_failed = set(plan.fail_blocks)
        self._failed_blocks.update(plan.fail_blocks)
        self._deps.step_started(plan, self._step_failed)
        if plan.awaits_report:  # only steps with loads can fail one; their report always comes
            self._report.step = plan.step
        self._write_settled()  # held stores every rank's report settled, before any read
        self._start_async(plan)
        close_reads(self._loading)  # a step vLLM abandoned before finish_load
        self._loading = [self._read_job(job) for job in plan.loads]
        for job, outcome, _, _ in self._loading:
            self._report.loads[job.request_id] = outcome
            self._step_failed.update(outcome.failed_block_ids)
            self._failed_blocks.update(outcome.failed_block_ids)
        step = self._step_of(plan)
        step.start_loads([load for _, _, staged, _ in self._loading for _, load, _ in staged])
        if not self.config.use_layerwise or not layer_hooks:
            step.wait_all()  # every layer before the first

    # ---- loads outside the step (vLLM's asynchronous loads) --------------------------------
    def _start_async(self, plan: StepPlan) -> None:
        if not plan.async_loads and not plan.cancel_async:
            return
        if self._async is None:
            self._async = AsyncLoader(self._load_outside_step)
        for rid in plan.cancel_async:
            self._async.cancel(rid)
        for job in plan.async_loads:
            self._async.submit(job)

    def _load_outside_step(
        self, job: LoadJob, effects: list[Callable[[], None]], cancelled: Callable[[], bool]
    ) -> LoadOutcome:
        """Read, check and copy a job's chunks on the asynchronous-load thread."""
        assert self.copier is not None
        if cancelled():  # every rank's outcome lists the job's chunks, loaded or not
            return LoadOutcome.not_started(job.request_id, job.chunks)
        _, outcome, staged, opened = self._read_job(job, effects)
        try:
            return self._copy_outside_step(job, outcome, staged, effects, cancelled)
        finally:
            close_reads([(job, outcome, staged, opened)])  # nothing writes into its blocks after

    def _copy_outside_step(
        self,
        job: LoadJob,
        outcome: LoadOutcome,
        staged: list[Staged],
        effects: list[Callable[[], None]],
        cancelled: Callable[[], bool],
    ) -> LoadOutcome:
        assert self.copier is not None
        outcome.failed_block_ids.extend(job.fail_blocks)
        copied: dict[str, TierTraffic] = {}  # what each tier's chunks moved into the KV cache
        loads = [load for _, load, _ in staged]
        for i in range(self.copier.num_layers):  # layer-major: a disk load's reads run ahead
            if cancelled():
                break
            for load in loads:
                if load.error is None:
                    try:
                        load.seconds += copy_load_layer(self.copier, load, i, cancelled)
                    except Exception as e:  # noqa: BLE001 - this chunk on is recomputed
                        load.error = e
        self.copier.synchronize()  # a device's copies are done before the load is reported
        for position, (result, load, chunk) in enumerate(staged):
            if cancelled():  # its request is gone; what was read whole is still promoted
                self._settle_promotions(staged[position:], effects)
                break
            if load.error is not None:
                run_or_defer(effects, lambda e=load.error, t=result.tier: self._layer_failed(t, e))
                self._fail_from(outcome, staged[position:], load.error, effects)
                break
            outcome.seconds += load.seconds + load.waited
            if load.promote is not None:
                effects.append(load.promote)
            if result.tier is not None:
                traffic = copied.setdefault(result.tier, TierTraffic())
                traffic.add_moved(Stage.COPY, self._payload_bytes(chunk), copy_seconds(load))
        if copied:  # counted on the step thread, with the step's report
            effects.append(lambda: self._count_copies(copied))
        return outcome

    def _settle_promotions(self, staged: list[Staged], effects: list[Callable[[], None]]) -> None:
        """Promotions still waiting for their chunk's read: made once it is read whole and
        checked, else reported failed (the scheduler admitted them to the faster tiers)."""
        assert self.copier is not None
        for _, load, chunk in staged:
            if load.promote is None:
                continue
            try:
                if load.source is not None:
                    load.source.wait_layer(self.copier.num_layers - 1)
                effects.append(load.promote)
            except Exception as e:  # noqa: BLE001 - the promotion is reported failed
                reason = classify(e)[0]
                for tier_name in chunk.promote_to:
                    failure = StoreFailure("", chunk.name, tier_name, reason)
                    effects.append(lambda f=failure: self._report.store_failures.append(f))
            load.promote = None

    def _count_copies(self, copied: dict[str, TierTraffic]) -> None:
        for tier, traffic in copied.items():
            self._report.tier_traffic(tier).merge(traffic)

    def take_finished_loads(self, idle: bool = False) -> tuple[set[str], list[tuple[LoadJob, LoadOutcome]]]:
        """Asynchronous loads done since the last step: vLLM's ``finished_recving``; their
        failed blocks go to vLLM with this step's, and their outcomes to the scheduler. In a
        step that computed nothing, wait a little for one to finish instead of spinning."""
        if self._async is None:
            return set(), []
        if idle:
            self._async.wait_finished(IDLE_WAIT_S)
        finished: set[str] = set()
        done: list[tuple[LoadJob, LoadOutcome]] = []
        for load in self._async.take_finished():
            assert load.outcome is not None
            for effect in load.effects:
                effect()
            outcome = load.outcome
            if outcome.cancelled:
                outcome.failed_block_ids = []  # its request is gone; vLLM frees its blocks now
            elif outcome.failed:
                self._failed_blocks.update(outcome.failed_block_ids)
                self._log_failed_load(load.job, outcome)
            self._report.loads[load.job.request_id] = outcome
            finished.add(load.job.request_id)
            done.append((load.job, outcome))
        return finished, done

    def wait_layer(self, layer_name: str) -> None:
        """Returns once layer ``layer_name``'s loads of this step are in its KV tensor."""
        if self._step is not None:
            self._step.wait_layer(layer_name)

    def finish_load(self) -> list[LoadOutcome]:
        """Waits for the step's load copies; their outcomes, in job order (empty if none)."""
        loading, self._loading = self._loading, []
        if self._step is not None:
            self._step.wait_all()
        close_reads(loading)  # a read still under way (a chunk after a failed one) stops here
        outcomes = []
        for job, outcome, staged, _ in loading:
            for position, (result, load, _) in enumerate(staged):
                if load.error is not None:  # the copy or its layer's read raised: recomputed on
                    self._layer_failed(result.tier, load.error)
                    self._fail_from(outcome, staged[position:], load.error)
                    self._step_failed.update(outcome.failed_block_ids)
                    self._failed_blocks.update(outcome.failed_block_ids)
                    break
                if load.promote is not None:
                    load.promote()
            outcome.seconds += sum(load.seconds + load.waited for _, load, _ in staged)  # reads + copies
            for result, load, chunk in staged:
                if result.tier is not None:
                    traffic = self._report.tier_traffic(result.tier)
                    traffic.add_moved(Stage.COPY, self._payload_bytes(chunk), copy_seconds(load))
            if outcome.failed:
                self._log_failed_load(job, outcome)
            outcomes.append(outcome)
        return outcomes

    def _read_job(self, job: LoadJob, effects: list[Callable[[], None]] | None = None) -> ReadJob:
        """Reads and checks a job's chunks; the copies to make for the ones that are usable.

        ``effects``: off the step thread, what changes the step's state (promotions into
        faster tiers, the report's store failures) is appended there to run on it later."""
        return read_safely(job, lambda opened: self._read_chunks(job, opened, effects))

    def _read_chunks(self, job: LoadJob, opened: Opened, effects: list[Callable[[], None]] | None) -> ReadJob:
        outcome = LoadOutcome(job.request_id)
        started = time.perf_counter()
        staged: list[Staged] = []
        lease = self._pool.lease()  # the CPU-tier views it reads: not reused before it is closed
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
                    outcome.nbytes += self._payload_bytes(chunk)
                    staged.append((result, load, chunk))
                failed = not result.ok
            if not result.ok:
                outcome.failed_block_ids.extend(chunk.block_ids)
                for tier_name in chunk.promote_to:  # admitted for a copy that never came
                    failure = StoreFailure(
                        job.request_id, chunk.name, tier_name, result.reason or FailureReason.IO_ERROR
                    )
                    run_or_defer(effects, lambda f=failure: self._report.store_failures.append(f))
        remote = self.tiers.get(REMOTE)
        if isinstance(remote, BackgroundTier):
            while remote.reads:
                outcome.remote_calls.append(remote.reads.popleft())
        outcome.seconds = time.perf_counter() - started  # the copies' time is added when done
        return job, outcome, staged, opened

    def _fail_from(
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
            outcome.nbytes -= self._payload_bytes(chunk)
            outcome.failed_block_ids.extend(chunk.block_ids)
            if load.promote is not None:
                load.promote = None
                for tier_name in chunk.promote_to:
                    failure = StoreFailure(outcome.request_id, chunk.name, tier_name, result.reason)
                    run_or_defer(effects, lambda f=failure: self._report.store_failures.append(f))

    def _layer_failed(self, tier_name: str | None, error: BaseException) -> None:
        """A chunk's read failed after its header was good (a layer's checksum or read)."""
        if tier_name in self.health and not isinstance(error, CopyStalled):
            self.health[tier_name].failed(*classify(error))

    def _payload_bytes(self, chunk: ChunkLoad) -> int:
        return len(chunk.block_ids) * self.facts.block_bytes * self.facts.num_layers

    @staticmethod
    def _log_failed_load(job: LoadJob, outcome: LoadOutcome) -> None:
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
        tier, health = self.tiers.get(tier_name), self.health.get(tier_name)
        names = [storage_name(chunk.name, self.rank) for chunk in chunks]
        if tier is None or health is None or not health.usable():
            return iter([ConnectionAbortedError(f"{tier_name} tier is skipped")] * len(names))
        if isinstance(tier, BackgroundTier) and tier.layered and self.copier is not None:
            # layer 0 of each first; a whole chunk nobody promotes goes straight into its blocks
            targets = [
                None if chunk.promote_to or chunk.first_block else self.copier.load_targets(chunk.block_ids)
                for chunk in chunks
            ]
            reads = tier.get_layered(names, self.copier.num_layers, targets)
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
        assert self.copier is not None
        name = storage_name(chunk.name, self.rank)
        source = first_read if isinstance(first_read, LayeredRecord) else None
        read = first_read.payload() if isinstance(first_read, LayeredRecord) else first_read
        for tier_name in [chunk.tier] + [t for t in self.tiers if t != chunk.tier]:
            if tier_name != chunk.tier:
                if not self.health[tier_name].usable():
                    continue
                source, read = None, lease.read(self.tiers[tier_name], name)
            if read is None and source is not None:  # its layers are read straight into its blocks
                result.tier = tier_name
                self.health[tier_name].succeeded()
                nothing_to_copy: CopyPairs = [[] for _ in range(self.copier.num_layers)]
                return BlockLoad(NO_PAYLOAD, chunk.block_ids, chunk.first_block, nothing_to_copy, source)
            error: BaseException | None = read if isinstance(read, BaseException) else None
            if error is None:
                try:
                    payload = self.copier.payload_view(read)  # type: ignore[arg-type]
                    self.copier.check_payload(payload, len(chunk.block_ids), chunk.first_block)
                except ValueError as e:
                    error = e
            if error is None:
                result.tier = tier_name
                self.health[tier_name].succeeded()
                promote = None
                if chunk.promote_to:  # once every layer is read and checked, and copied
                    promote = lambda read=read: self._promote(chunk, name, read)  # type: ignore[misc]  # noqa: E731
                    if source is None:
                        run_or_defer(effects, promote)
                        promote = None
                pairs = (
                    None
                    if self._runner is None and effects is None and source is None
                    else self.copier.load_pairs(payload, chunk.block_ids, chunk.first_block)
                )
                return BlockLoad(payload, chunk.block_ids, chunk.first_block, pairs, source, promote)
            reason, detail = classify(error)
            if isinstance(error, ConnectionAbortedError):
                reason = FailureReason.TIER_UNHEALTHY
            self.health[tier_name].failed(reason, detail)
            if tier_name == chunk.tier:
                result.reason, result.detail = reason, detail
        return None

    def _promote(self, chunk: ChunkLoad, name: str, payload: memoryview) -> None:
        """Keep a chunk read from a slower tier in the faster ones the scheduler admitted it to."""
        for tier_name in chunk.promote_to:
            if tier_name in self.tiers:
                try:
                    self._put(tier_name, name, payload, "", chunk.num_tokens)
                except (OSError, QueueFull) as e:
                    reason, detail = classify(e)
                    self._report.store_failures.append(
                        StoreFailure("", chunk.name, tier_name, reason, detail)
                    )

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # ---- stores -------------------------------------------------------------------------
    def save_layer(self, plan: StepPlan, layer_name: str) -> None:
        """Layer ``layer_name``'s KV of this step is complete: the step's stores copy it out now,
        beside the layers still computing (only with a copy runner; otherwise ``save`` does)."""
        if self._runner is None or not self.config.use_layerwise or not plan.writes:
            return
        step = self._step_of(plan)
        self._prepare_gathers(step, plan)
        step.gather_layer(layer_name)

    def _prepare_gathers(self, step: StepCopies, plan: StepPlan) -> None:
        if step.gathers is None:  # the step's first layer: one buffer per store to make
            step.gathers = {
                id(op): self._gather_for(op)
                for op in plan.writes
                if isinstance(op, StoreJob)
                and any(t in self.tiers and self.health[t].usable() for t in op.tiers)
            }

    def save(self, plan: StepPlan) -> list[StoreFailure]:
        """Evictions and stores in plan order; returns the failed or withdrawn stores written
        in this call. Ends the step: on CPU every copy it started is done and its writes are
        made when this returns; on CUDA the next step's kernels come after its copies, and its
        writes are made once the device has copied its stores out (a later hook)."""
        step = self._step_of(plan)
        on_device = self._runner is not None and not self._runner.copies_on_host
        if on_device:
            self._prepare_gathers(step, plan)  # gathered on the device's stream, never inline
        step.finish_gathers()
        self._step = None
        self._retire_if_stalled(step)
        withdrawn = {id(job) for job in plan.stores if self._deps.over_failed_load(job)}
        names = {op.name for op in plan.writes}
        self._unwritten.append(StepWrites(plan, step, withdrawn, names, on_device))
        failures = self._write_ready(self._unwritten[-1] if plan.drain else None)
        if plan.drain:
            for tier in self._background:
                tier.drain(DRAIN_WAIT_S)
        return failures

    def _write_before(self, plan: StepPlan) -> None:
        """Writes still waiting for a device's copies are made before this step reads any chunk
        they write, in the step or outside it (the tiers then hold what the scheduler's index
        says); the rest when ready."""
        needed = {chunk.name for job in (*plan.loads, *plan.async_loads) for chunk in job.chunks}
        through = None
        for queued in self._unwritten:
            if not needed.isdisjoint(queued.names):
                through = queued
        self._write_ready(through)

    def _write_ready(self, through: StepWrites | None = None) -> list[StoreFailure]:
        """Makes queued steps' writes, in step order, while their gathers are in host memory;
        up to ``through``, waits for them (bounded; gathers not done in time fail)."""
        failures: list[StoreFailure] = []
        while self._unwritten:
            queued = self._unwritten[0]
            if through is not None:
                queued.copies.wait_gathers()
                self._retire_if_stalled(queued.copies)
            elif not queued.copies.gathers_ready():
                break
            self._unwritten.popleft()
            failures += self._write(queued)
            if queued is through:
                through = None
        self._report.store_failures.extend(failures)
        return failures

    def _write(self, queued: StepWrites) -> list[StoreFailure]:
        gathers = queued.copies.gathers or {}
        failures: list[StoreFailure] = []
        for op in queued.plan.writes:
            if isinstance(op, Eviction):
                self._evict(op)
            elif id(op) in queued.withdrawn:
                failures += self._fail(
                    op, op.tiers, FailureReason.DEPENDENCY_FAILED, "computed over a failed load"
                )
            elif queued.on_device and id(op) not in gathers:
                # its blocks may hold other KV by now: only what was gathered in its step is stored
                failures += self._fail(
                    op, op.tiers, FailureReason.TIER_UNHEALTHY, "no usable tier in its step"
                )
            else:
                failures += self._store(op, gathers.get(id(op)), queued.plan.step)
        return failures

    def _write_settled(self) -> None:
        """Held stores every rank's report has settled: written, or withdrawn on every rank."""
        oldest = self._unwritten[0].plan.step if self._unwritten else None
        self._report.store_failures += self._deps.write_settled(oldest, self._write_payload)

    def _gather_for(self, job: StoreJob) -> BlockGather:
        assert self.copier is not None
        out = self._new_payload(len(job.block_ids))
        return BlockGather(out, job.block_ids, self.copier.gather_pairs(out, job.block_ids))

    def _new_payload(self, num_blocks: int) -> torch.Tensor:
        """A buffer to gather a chunk into: one the CPU tier dropped, else new memory."""
        assert self.copier is not None
        shape = (self.copier.num_layers, num_blocks, self.copier.block_bytes)
        reused = self._pool.take(shape)  # host memory (page-locked, gathered on CUDA) either way
        return reused if reused is not None else self.copier.new_payload(num_blocks)

    def _step_of(self, plan: StepPlan) -> StepCopies:
        """This step's copies (a new step when the plan is new; a step vLLM abandoned midway,
        by raising, is waited for first: its copies must not outlive it)."""
        if self._step is None or self._step.plan is not plan:
            if self._step is not None:
                self._step.wait_all()
                self._retire_if_stalled(self._step)
            assert self.copier is not None
            self._step = StepCopies(plan, self.copier, self._runner)
        return self._step

    def _retire_if_stalled(self, step: StepCopies) -> None:
        """After the copy thread died or stalled, later steps copy in the step, on this thread
        (a device's stream is kept: copying in the step would wait on the same device)."""
        if step.stalled is None or self._runner is None:
            return
        if not self._runner.copies_on_host:
            logger.error("KVLens: %s; this step's unfinished stores are dropped", step.stalled)
            return
        logger.error(
            "KVLens: %s; this step's unfinished loads are recomputed and its stores dropped, "
            "and copies run in the step from now on",
            step.stalled,
        )
        self._runner.close(0.0)
        self._runner = None

    def _evict(self, op: Eviction) -> None:
        tier = self.tiers.get(op.tier)
        if tier is None:
            return
        self._deps.drop(op.tier, op.name)  # a store of it still held comes before this eviction
        try:
            tier.delete(storage_name(op.name, self.rank))
        except OSError as e:  # a stale copy costs space, never correctness: its index entry is gone
            logger.debug("KVLens: evicting %s from %s failed: %s", op.name[:12], op.tier, e)

    def _store(self, job: StoreJob, gathered: BlockGather | None, step: int) -> list[StoreFailure]:
        usable = [t for t in job.tiers if t in self.tiers and self.health[t].usable()]
        failures = self._fail(job, [t for t in job.tiers if t not in usable], FailureReason.TIER_UNHEALTHY)
        if not usable:
            return failures
        assert self.copier is not None
        started = time.perf_counter()
        try:
            if gathered is None:
                data = self.copier.gather(job.block_ids, self._new_payload(len(job.block_ids)))
            elif gathered.error is not None:
                raise gathered.error
            else:
                data = gathered.out  # host memory; its copies are done (``gathers_ready``)
        except (RuntimeError, ValueError) as e:
            return failures + self._fail(job, usable, FailureReason.IO_ERROR, str(e))
        gather_s = time.perf_counter() - started + (gathered.seconds if gathered is not None else 0.0)
        payload = memoryview(data.numpy()).cast("B")
        for tier_name in usable:  # one gather feeds every tier the chunk goes to
            self._report.tier_traffic(tier_name).add_moved(Stage.GATHER, payload.nbytes, gather_s)
        if job.settled_by >= 0:  # written once every rank's loads it depends on are reported
            self._deps.hold(step, job, usable, payload, data)
            return failures
        return failures + self._write_payload(job, usable, payload, data)

    def _write_payload(
        self, job: StoreJob, tiers: list[str], payload: memoryview, data: torch.Tensor
    ) -> list[StoreFailure]:
        usable = [t for t in tiers if self.health[t].usable()]  # a held store: checked again
        failures = self._fail(job, [t for t in tiers if t not in usable], FailureReason.TIER_UNHEALTHY)
        if usable == [CPU]:  # only the CPU tier reads it: reusable once dropped
            self._pool.own(payload, data)
        name = storage_name(job.name, self.rank)
        for tier_name in usable:
            try:
                self._put(tier_name, name, payload, job.namespace, job.num_tokens)
            except QueueFull as e:
                failures += self._fail(job, [tier_name], FailureReason.QUEUE_FULL, str(e))
            except OSError as e:
                reason, detail = classify(e)
                self.health[tier_name].failed(reason, detail)
                failures += self._fail(job, [tier_name], reason, detail)
        return failures

    def _put(self, tier_name: str, name: str, payload: memoryview, namespace: str, tokens: int) -> None:
        """Write to a tier; a store counts once the tier holds it: at once for the CPU tier,
        when its background write lands for the others (``take_report``)."""
        tier = self.tiers[tier_name]
        if isinstance(tier, BackgroundTier):
            tier.put(name, payload, namespace, tokens)
            return
        tier.put(name, payload, namespace)
        self._pool.trim()  # the chunks may have taken room the kept buffers held
        n = self._counts_chunks
        self._report.tier_traffic(tier_name).add_stored(n, tokens * n, payload.nbytes)

    @staticmethod
    def _fail(job: StoreJob, tiers: object, reason: FailureReason, detail: str = "") -> list[StoreFailure]:
        return [StoreFailure(job.request_id, job.name, t, reason, detail) for t in tiers]  # type: ignore[attr-defined]

    # ---- report, health and lifecycle ---------------------------------------------------
    def take_report(self) -> WorkerReport | None:
        self._write_ready()  # stores a device has copied out since
        report = self._report
        for tier in self._background:
            if tier.stuck():
                tier.health.failed(FailureReason.TIMEOUT, "a write has not finished")
        # The count before what landed: a write landing in between is in both, never in neither.
        # A skipped tier's queue counts too: its writes' outcomes are still to be reported.
        pending = sum(t.pending for t in self._background)
        pending += sum(len(q.plan.stores) for q in self._unwritten) + len(self._deps)
        for tier in self._background:
            traffic = tier.take_traffic(self._counts_chunks)
            if not traffic.is_empty():
                report.tier_traffic(tier.name).merge(traffic)
            for name, reason, detail in tier.take_failures():
                report.store_failures.append(StoreFailure("", self._digest(name), tier.name, reason, detail))
            for name, nbytes in tier.take_kept():
                report.kept.append(KeptChunk(tier.name, self._digest(name), nbytes))
            deleted = tier.take_deleted()
            if self.rank == 0:  # one rank's files stand for the chunk: counted once
                report.deleted.extend((tier.name, self._digest(name)) for name in deleted)
        self._probe_skipped_tiers()
        for name, health in self.health.items():
            change = health.take_change()
            if change is not None:
                report.tier_states[name] = change
        if pending or pending != self._reported_pending:  # while any, and the drop to 0: draining stops
            report.pending_writes = self._reported_pending = pending
        if report.is_empty():
            return None
        self._report = WorkerReport()
        return report

    def _digest(self, name: str) -> str:
        return name.removesuffix(self._suffix)

    def _probe_skipped_tiers(self) -> None:
        for tier in self._background:
            health = tier.health
            probe = getattr(tier.inner, "probe", None) or getattr(tier.inner, "ping", None)
            if probe is not None and health.probe_due():
                future = tier.run(probe)
                future.add_done_callback(
                    lambda f, h=health: h.probe_done(f.exception() is None, str(f.exception()))
                )

    def take_remote_calls(self) -> list[RemoteCall]:
        """Remote writes and deletes done since the last call (reads go with their loads)."""
        remote = self.tiers.get(REMOTE)
        if not isinstance(remote, BackgroundTier) or remote.calls is None:
            return []
        out = []
        while remote.calls:
            out.append(remote.calls.popleft())
        return out

    def tier_states(self) -> dict[str, TierState]:
        return {name: h.state for name, h in self.health.items()}

    def _cpu_used(self) -> int:
        cpu = self.tiers.get(CPU)
        return cpu.used_bytes if isinstance(cpu, CpuTier) else 0

    def sizes(self) -> WorkerSizes:
        """Internal sizes, for leak-spotting gauges."""
        cpu = self.tiers.get(CPU)
        return WorkerSizes(
            invalid_block_ids=len(self._failed_blocks),
            reusable_buffer_bytes=self._pool.bytes,
            cpu_tier_bytes=cpu.used_bytes if isinstance(cpu, CpuTier) else None,
        )

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait for every queued background write and delete (tests, shutdown)."""
        if self._unwritten:
            self._write_ready(self._unwritten[-1])
        return all(tier.drain(timeout_s) for tier in self._background)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the threads and free the memory: the CPU tier, reusable buffers, and the
        references to vLLM's KV tensors (an in-process engine may be gone, its process not)."""
        if self._step is not None:
            self._step.wait_all()
            self._step = None
        if self._unwritten:
            self._write_ready(self._unwritten[-1])
        if self._runner is not None:
            self._runner.close(timeout_s)
            self._runner = None
        if self._async is not None:
            self._async.close(timeout_s)
            self._async = None
        for tier in self._background:
            tier.close(timeout_s)
        cpu = self.tiers.get(CPU)
        if isinstance(cpu, CpuTier):
            cpu.clear()
        self._deps.clear()
        self._pool.clear()
        close_reads(self._loading)
        self._loading = []
        self.copier = None
