"""The step's writes: stores (gathered from the KV cache, then put to every usable tier they go
to, or held until every rank's loads they depend on are reported) and evictions, in plan order.
"""

from __future__ import annotations

import logging
import time

import torch

from ..engine.jobs import CPU, Eviction, StepPlan, StoreJob
from ..engine.keys import storage_name
from ..engine.outcomes import FailureReason, Stage, StoreFailure
from ..tiers.background import BackgroundTier, QueueFull
from ..tiers.base import classify
from .layer_copies import BlockGather
from .store_dependencies import StepWrites
from .worker_state import WorkerState

logger = logging.getLogger("vllm.kvlens")


class Writes:
    """Makes the writes of steps whose copies are done, in step order."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state

    def write_before(self, plan: StepPlan) -> None:
        """Writes still waiting for a device's copies are made before this step reads any chunk
        they write, in the step or outside it (the tiers then hold what the scheduler's index
        says); the rest when ready."""
        needed = {chunk.name for job in (*plan.loads, *plan.async_loads) for chunk in job.chunks}
        through = None
        for queued in self.state.unwritten:
            if not needed.isdisjoint(queued.names):
                through = queued
        self.write_ready(through)

    def write_ready(self, through: StepWrites | None = None) -> list[StoreFailure]:
        """Makes queued steps' writes, in step order, while their gathers are in host memory;
        up to ``through``, waits for them (bounded; gathers not done in time fail)."""
        failures: list[StoreFailure] = []
        while self.state.unwritten:
            queued = self.state.unwritten[0]
            if through is not None:
                queued.copies.wait_gathers()
                self.state.retire_if_stalled(queued.copies)
            elif not queued.copies.gathers_ready():
                break
            self.state.unwritten.popleft()
            failures += self._write(queued)
            if queued is through:
                through = None
        self.state.report.store_failures.extend(failures)
        return failures

    def _write(self, queued: StepWrites) -> list[StoreFailure]:
        gathers = queued.copies.gathers or {}
        failures: list[StoreFailure] = []
        for op in queued.plan.writes:
            if isinstance(op, Eviction):
                self.evict(op)
            elif id(op) in queued.withdrawn:
                failures += self.fail(
                    op, op.tiers, FailureReason.DEPENDENCY_FAILED, "computed over a failed load"
                )
            elif queued.on_device and id(op) not in gathers:
                # its blocks may hold other KV by now: only what was gathered in its step is stored
                failures += self.fail(
                    op, op.tiers, FailureReason.TIER_UNHEALTHY, "no usable tier in its step"
                )
            else:
                failures += self._store(op, gathers.get(id(op)), queued.plan.step)
        return failures

    def write_settled(self) -> None:
        """Held stores every rank's report has settled: written, or withdrawn on every rank."""
        oldest = self.state.unwritten[0].plan.step if self.state.unwritten else None
        self.state.report.store_failures += self.state.deps.write_settled(oldest, self.write_payload)

    def gather_for(self, job: StoreJob) -> BlockGather:
        assert self.state.copier is not None
        out = self.new_payload(len(job.block_ids))
        return BlockGather(out, job.block_ids, self.state.copier.gather_pairs(out, job.block_ids))

    def new_payload(self, num_blocks: int) -> torch.Tensor:
        """A buffer to gather a chunk into: one the CPU tier dropped, else new memory."""
        assert self.state.copier is not None
        shape = (self.state.copier.num_layers, num_blocks, self.state.copier.block_bytes)
        reused = self.state.pool.take(shape)  # host memory (page-locked, gathered on CUDA) either way
        return reused if reused is not None else self.state.copier.new_payload(num_blocks)

    def evict(self, op: Eviction) -> None:
        tier = self.state.tiers.get(op.tier)
        if tier is None:
            return
        self.state.deps.drop(op.tier, op.name)  # a store of it still held comes before this eviction
        try:
            tier.delete(storage_name(op.name, self.state.rank))
        except OSError as e:  # a stale copy costs space, never correctness: its index entry is gone
            logger.debug("KVLens: evicting %s from %s failed: %s", op.name[:12], op.tier, e)

    def _store(self, job: StoreJob, gathered: BlockGather | None, step: int) -> list[StoreFailure]:
        usable = [t for t in job.tiers if t in self.state.tiers and self.state.health[t].usable()]
        failures = self.fail(job, [t for t in job.tiers if t not in usable], FailureReason.TIER_UNHEALTHY)
        if not usable:
            return failures
        assert self.state.copier is not None
        started = time.perf_counter()
        try:
            if gathered is None:
                data = self.state.copier.gather(job.block_ids, self.new_payload(len(job.block_ids)))
            elif gathered.error is not None:
                raise gathered.error
            else:
                data = gathered.out  # host memory; its copies are done (``gathers_ready``)
        except (RuntimeError, ValueError) as e:
            return failures + self.fail(job, usable, FailureReason.IO_ERROR, str(e))
        if not self.state.tail_slots.clear(data, job.num_tokens):  # never another request's KV
            return failures + self.fail(job, usable, FailureReason.IO_ERROR, "unfull block's slots unknown")
        gather_s = time.perf_counter() - started + (gathered.seconds if gathered is not None else 0.0)
        payload = memoryview(data.numpy()).cast("B")
        for tier_name in usable:  # one gather feeds every tier the chunk goes to
            self.state.report.tier_traffic(tier_name).add_moved(Stage.GATHER, payload.nbytes, gather_s)
        if job.settled_by >= 0:  # written once every rank's loads it depends on are reported
            self.state.deps.hold(step, job, usable, payload, data)
            return failures
        return failures + self.write_payload(job, usable, payload, data)

    def write_payload(
        self, job: StoreJob, tiers: list[str], payload: memoryview, data: torch.Tensor
    ) -> list[StoreFailure]:
        usable = [t for t in tiers if self.state.health[t].usable()]  # a held store: checked again
        failures = self.fail(job, [t for t in tiers if t not in usable], FailureReason.TIER_UNHEALTHY)
        if usable == [CPU]:  # only the CPU tier reads it: reusable once dropped
            self.state.pool.own(payload, data)
        name = storage_name(job.name, self.state.rank)
        for tier_name in usable:
            try:
                self.put(tier_name, name, payload, job.namespace, job.num_tokens)
            except QueueFull as e:
                failures += self.fail(job, [tier_name], FailureReason.QUEUE_FULL, str(e))
            except OSError as e:
                reason, detail = classify(e)
                self.state.health[tier_name].failed(reason, detail)
                failures += self.fail(job, [tier_name], reason, detail)
        return failures

    def put(self, tier_name: str, name: str, payload: memoryview, namespace: str, tokens: int) -> None:
        """Write to a tier; a store counts once the tier holds it: at once for the CPU tier,
        when its background write lands for the others (``take_report``)."""
        tier = self.state.tiers[tier_name]
        if isinstance(tier, BackgroundTier):
            tier.put(name, payload, namespace, tokens)
            return
        tier.put(name, payload, namespace)
        self.state.pool.trim()  # the chunks may have taken room the kept buffers held
        n = self.state.counts_chunks
        self.state.report.tier_traffic(tier_name).add_stored(n, tokens * n, payload.nbytes)

    @staticmethod
    def fail(job: StoreJob, tiers: object, reason: FailureReason, detail: str = "") -> list[StoreFailure]:
        return [StoreFailure(job.request_id, job.name, t, reason, detail) for t in tiers]  # type: ignore[attr-defined]
