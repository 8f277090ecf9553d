"""The worker half: carries out the scheduler's plan against this rank's KV tensors.

Per step: loads before the forward pass, then the plan's evictions and stores in the order
the scheduler decided them. Nothing here raises into vLLM for a bad chunk or a failing tier:
a failed load becomes failed block ids (vLLM recomputes them); a store whose KV was computed
over a block that failed to load in this step is withdrawn, never written; every failure goes
back to the scheduler in the step's report, so its index keeps agreeing with the tiers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..config.loading import KVLensConfig
from ..engine.facts import EngineFacts
from ..engine.jobs import CPU, LoadJob, StepPlan, StoreJob
from ..engine.outcomes import (
    BlendOutcome,
    LoadOutcome,
    RemoteCall,
    Stage,
    StoreFailure,
    TierState,
    WorkerReport,
)
from ..engine.snapshots import WorkerSizes
from ..tiers.cpu import CpuTier
from .blend.blend_worker import WorkerBlend, vllm_backing
from .chunk_reads import ChunkReads
from .cuda_copies import CudaCopyStream, TorchCuda
from .kv_blocks import BlockCopier
from .layer_copies import CopyThread, StepCopies
from .loads_outside_step import LoadsOutsideStep
from .read_jobs import ReadJob, close_reads, copy_seconds
from .reports import Reports
from .store_dependencies import StepWrites
from .tail_slots import TailSlots
from .worker_state import WorkerState
from .writes import Writes

DRAIN_WAIT_S = 0.05  # an idle engine's empty step waits this long for background writes


class ConnectorWorker(WorkerState):
    """Coordinates one rank's parts through a step: its loads (``ChunkReads``, then copies beside
    the forward pass), vLLM's asynchronous loads (``LoadsOutsideStep``), its stores and evictions
    (``Writes``) and the report to the scheduler (``Reports``)."""

    def __init__(self, config: KVLensConfig, facts: EngineFacts, rank: int) -> None:
        super().__init__(config, facts, rank)
        self.writes = Writes(self)
        self.reads = ChunkReads(self, self.writes)
        self.async_loads = LoadsOutsideStep(self, self.reads)
        self.reports = Reports(self, self.writes)
        self.step_copies: StepCopies | None = None  # this step's copies, from its first hook to save()
        self._loading: list[ReadJob] = []  # this step's load jobs, from start_load to finish_load

    def register(
        self,
        kv_caches: dict[str, torch.Tensor],
        num_blocks: int,
        block_slots: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
    ) -> None:
        """``block_slots(kv)``: the token slot of each element of a block (``vllm_compat``), probed
        where unfull chunks leave the worker (PD sends, exact tails stored)."""
        copier = BlockCopier(kv_caches, num_blocks)
        if copier.block_bytes != self.facts.block_bytes or copier.num_layers != self.facts.num_layers:
            raise ValueError(
                f"KVLens: KV tensors hold {copier.num_layers} layers x {copier.block_bytes} bytes "
                f"per block; the scheduler planned {self.facts.num_layers} x {self.facts.block_bytes}"
            )
        self.copier = copier
        if block_slots is not None and (self.config.pd.sender or self.config.saves_partial_chunks):
            slots = block_slots(copier.layers[0].tensor)  # every layer has its shape and packing
            self.tail_slots = TailSlots.of(copier, self.facts.block_size, slots)
        if self.runner is None and copier.device.type == "cuda":
            self.runner = CudaCopyStream(TorchCuda(copier.device))
        elif self.runner is None and self.config.use_layerwise and copier.device.type == "cpu":
            self.runner = CopyThread()

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
        self.writes.write_before(plan)
        self.step_failed = set(plan.fail_blocks)
        self.failed_blocks.update(plan.fail_blocks)
        self.deps.step_started(plan, self.step_failed)
        if plan.awaits_report:  # only steps with loads can fail one; their report always comes
            self.report.step = plan.step
        self.writes.write_settled()  # held stores every rank's report settled, before any read
        self.async_loads.start(plan)
        close_reads(self._loading)  # a step vLLM abandoned before finish_load
        self._loading = [self.reads.read_job(job) for job in plan.loads]
        for job, outcome, _, _ in self._loading:
            self.report.loads[job.request_id] = outcome
            self.step_failed.update(outcome.failed_block_ids)
            self.failed_blocks.update(outcome.failed_block_ids)
        step = self._step_of(plan)
        step.start_loads([load for _, _, staged, _ in self._loading for _, load, _ in staged])
        if not self.config.use_layerwise or not layer_hooks:
            step.wait_all()  # every layer before the first

    def blender(self, find_model: Callable[[], Any]) -> WorkerBlend:
        """This rank's blender (``enable_blending``), writing to this rank's tiers."""
        return WorkerBlend(
            self.rank,
            self.facts.block_size,
            self.tiers,
            lambda tier: self.health[tier].usable(),
            self.writes.put,
            vllm_backing(find_model, self.config.blend),
        )

    def blended(self, outcomes: list[BlendOutcome], store_failures: list[StoreFailure]) -> None:
        """The step's blends ran: a blend that failed leaves its blocks to vLLM to compute."""
        for outcome in outcomes:
            self.report.blends[outcome.request_id] = outcome
            self.step_failed.update(outcome.failed_block_ids)
            self.failed_blocks.update(outcome.failed_block_ids)
        self.report.store_failures.extend(store_failures)

    def wait_layer(self, layer_name: str) -> None:
        """Returns once layer ``layer_name``'s loads of this step are in its KV tensor."""
        if self.step_copies is not None:
            self.step_copies.wait_layer(layer_name)

    def finish_load(self) -> list[LoadOutcome]:
        """Waits for the step's load copies; their outcomes, in job order (empty if none)."""
        loading, self._loading = self._loading, []
        if self.step_copies is not None:
            self.step_copies.wait_all()
        close_reads(loading)  # a read still under way (a chunk after a failed one) stops here
        outcomes = []
        for job, outcome, staged, _ in loading:
            for position, (result, load, _) in enumerate(staged):
                if load.error is not None:  # the copy or its layer's read raised: recomputed on
                    self.reads.layer_failed(result.tier, load.error)
                    self.reads.fail_from(outcome, staged[position:], load.error)
                    self.step_failed.update(outcome.failed_block_ids)
                    self.failed_blocks.update(outcome.failed_block_ids)
                    break
                if load.promote is not None:
                    load.promote()
            outcome.seconds += sum(load.seconds + load.waited for _, load, _ in staged)  # reads + copies
            for result, load, chunk in staged:
                if result.tier is not None:
                    traffic = self.report.tier_traffic(result.tier)
                    traffic.add_moved(Stage.COPY, self.reads.payload_bytes(chunk), copy_seconds(load))
            if outcome.failed:
                self.reads.log_failed_load(job, outcome)
            outcomes.append(outcome)
        return outcomes

    def take_failed_blocks(self) -> set[int]:
        failed, self.failed_blocks = self.failed_blocks, set()
        return failed

    def save_layer(self, plan: StepPlan, layer_name: str) -> None:
        """Layer ``layer_name``'s KV of this step is complete: the step's stores copy it out now,
        beside the layers still computing (only with a copy runner; otherwise ``save`` does)."""
        if self.runner is None or not self.config.use_layerwise or not plan.writes:
            return
        step = self._step_of(plan)
        self._prepare_gathers(step, plan)
        step.gather_layer(layer_name)

    def _prepare_gathers(self, step: StepCopies, plan: StepPlan) -> None:
        if step.gathers is None:  # the step's first layer: one buffer per store to make
            step.gathers = {
                id(op): self.writes.gather_for(op)
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
        on_device = self.runner is not None and not self.runner.copies_on_host
        if on_device:
            self._prepare_gathers(step, plan)  # gathered on the device's stream, never inline
        step.finish_gathers()
        self.step_copies = None
        self.retire_if_stalled(step)
        withdrawn = {id(job) for job in plan.stores if self.deps.over_failed_load(job)}
        names = {op.name for op in plan.writes}
        self.unwritten.append(StepWrites(plan, step, withdrawn, names, on_device))
        failures = self.writes.write_ready(self.unwritten[-1] if plan.drain else None)
        if plan.drain:
            for tier in self.background:
                tier.drain(DRAIN_WAIT_S)
        return failures

    def _step_of(self, plan: StepPlan) -> StepCopies:
        """This step's copies (a new step when the plan is new; a step vLLM abandoned midway,
        by raising, is waited for first: its copies must not outlive it)."""
        if self.step_copies is None or self.step_copies.plan is not plan:
            if self.step_copies is not None:
                self.step_copies.wait_all()
                self.retire_if_stalled(self.step_copies)
            assert self.copier is not None
            self.step_copies = StepCopies(plan, self.copier, self.runner)
        return self.step_copies

    def tier_states(self) -> dict[str, TierState]:
        return {name: h.state for name, h in self.health.items()}

    def sizes(self) -> WorkerSizes:
        """Internal sizes, for leak-spotting gauges."""
        cpu = self.tiers.get(CPU)
        return WorkerSizes(
            invalid_block_ids=len(self.failed_blocks),
            reusable_buffer_bytes=self.pool.bytes,
            cpu_tier_bytes=cpu.used_bytes if isinstance(cpu, CpuTier) else None,
        )

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait for every queued background write and delete (tests, shutdown)."""
        if self.unwritten:
            self.writes.write_ready(self.unwritten[-1])
        return all(tier.drain(timeout_s) for tier in self.background)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the threads and free the memory: the CPU tier, reusable buffers, and the
        references to vLLM's KV tensors (an in-process engine may be gone, its process not)."""
        if self.step_copies is not None:
            self.step_copies.wait_all()
            self.step_copies = None
        if self.unwritten:
            self.writes.write_ready(self.unwritten[-1])
        if self.runner is not None:
            self.runner.close(timeout_s)
            self.runner = None
        self.async_loads.close(timeout_s)
        for tier in self.background:
            tier.close(timeout_s)
        cpu = self.tiers.get(CPU)
        if isinstance(cpu, CpuTier):
            cpu.clear()
        self.deps.clear()
        self.pool.clear()
        close_reads(self._loading)
        self._loading = []
        self.copier = None

    def take_finished_loads(self, idle: bool = False) -> tuple[set[str], list[tuple[LoadJob, LoadOutcome]]]:
        """Asynchronous loads done since the last step (``LoadsOutsideStep.take_finished``)."""
        return self.async_loads.take_finished(idle)

    def take_report(self) -> WorkerReport | None:
        """What happened since the last report, or None (``Reports.take``)."""
        return self.reports.take()

    def take_remote_calls(self) -> list[RemoteCall]:
        """Remote writes and deletes done since the last call (reads go with their loads)."""
        return self.reports.take_remote_calls()
