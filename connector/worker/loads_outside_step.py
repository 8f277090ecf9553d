"""vLLM's asynchronous loads: read, checked and copied into the KV cache on a thread of their own
while steps go on; what they change in the step's state runs on the step thread when taken.
"""

from __future__ import annotations

from collections.abc import Callable

from ..engine.jobs import LoadJob, StepPlan
from ..engine.outcomes import LoadOutcome, Stage, StoreFailure, TierTraffic
from ..tiers.base import classify
from .async_loads import AsyncLoader
from .chunk_reads import ChunkReads
from .layer_copies import copy_load_layer
from .read_jobs import Staged, close_reads, copy_seconds, run_or_defer
from .worker_state import WorkerState

IDLE_WAIT_S = 0.01  # a step that computed nothing waits this long for an asynchronous load


class LoadsOutsideStep:
    """The asynchronous loads of one rank, from submission to vLLM's ``finished_recving``."""

    def __init__(self, state: WorkerState, reads: ChunkReads) -> None:
        self.state = state
        self.reads = reads
        self._loader: AsyncLoader | None = None  # started on first use

    def start(self, plan: StepPlan) -> None:
        if not plan.async_loads and not plan.cancel_async:
            return
        if self._loader is None:
            self._loader = AsyncLoader(self._load_outside_step)
        for rid in plan.cancel_async:
            self._loader.cancel(rid)
        for job in plan.async_loads:
            self._loader.submit(job)

    def _load_outside_step(
        self, job: LoadJob, effects: list[Callable[[], None]], cancelled: Callable[[], bool]
    ) -> LoadOutcome:
        """Read, check and copy a job's chunks on the asynchronous-load thread."""
        assert self.state.copier is not None
        if cancelled():  # every rank's outcome lists the job's chunks, loaded or not
            return LoadOutcome.not_started(job.request_id, job.chunks)
        _, outcome, staged, opened = self.reads.read_job(job, effects)
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
        assert self.state.copier is not None
        outcome.failed_block_ids.extend(job.fail_blocks)
        copied: dict[str, TierTraffic] = {}  # what each tier's chunks moved into the KV cache
        loads = [load for _, load, _ in staged]
        for i in range(self.state.copier.num_layers):  # layer-major: a disk load's reads run ahead
            if cancelled():
                break
            for load in loads:
                if load.error is None:
                    try:
                        load.seconds += copy_load_layer(self.state.copier, load, i, cancelled)
                    except Exception as e:  # noqa: BLE001 - this chunk on is recomputed
                        load.error = e
        self.state.copier.synchronize()  # a device's copies are done before the load is reported
        for position, (result, load, chunk) in enumerate(staged):
            if cancelled():  # its request is gone; what was read whole is still promoted
                self._settle_promotions(staged[position:], effects)
                break
            if load.error is not None:
                run_or_defer(effects, lambda e=load.error, t=result.tier: self.reads.layer_failed(t, e))
                self.reads.fail_from(outcome, staged[position:], load.error, effects)
                break
            outcome.seconds += load.seconds + load.waited
            if load.promote is not None:
                effects.append(load.promote)
            if result.tier is not None:
                traffic = copied.setdefault(result.tier, TierTraffic())
                traffic.add_moved(Stage.COPY, self.reads.payload_bytes(chunk), copy_seconds(load))
        if copied:  # counted on the step thread, with the step's report
            effects.append(lambda: self._count_copies(copied))
        return outcome

    def _settle_promotions(self, staged: list[Staged], effects: list[Callable[[], None]]) -> None:
        """Promotions still waiting for their chunk's read: made once it is read whole and
        checked, else reported failed (the scheduler admitted them to the faster tiers)."""
        assert self.state.copier is not None
        for _, load, chunk in staged:
            if load.promote is None:
                continue
            try:
                if load.source is not None:
                    load.source.wait_layer(self.state.copier.num_layers - 1)
                effects.append(load.promote)
            except Exception as e:  # noqa: BLE001 - the promotion is reported failed
                reason = classify(e)[0]
                for tier_name in chunk.promote_to:
                    failure = StoreFailure("", chunk.name, tier_name, reason)
                    effects.append(lambda f=failure: self.state.report.store_failures.append(f))
            load.promote = None

    def _count_copies(self, copied: dict[str, TierTraffic]) -> None:
        for tier, traffic in copied.items():
            self.state.report.tier_traffic(tier).merge(traffic)

    def take_finished(self, idle: bool = False) -> tuple[set[str], list[tuple[LoadJob, LoadOutcome]]]:
        """Asynchronous loads done since the last step: vLLM's ``finished_recving``; their
        failed blocks go to vLLM with this step's, and their outcomes to the scheduler. In a
        step that computed nothing, wait a little for one to finish instead of spinning."""
        if self._loader is None:
            return set(), []
        if idle:
            self._loader.wait_finished(IDLE_WAIT_S)
        finished: set[str] = set()
        done: list[tuple[LoadJob, LoadOutcome]] = []
        for load in self._loader.take_finished():
            assert load.outcome is not None
            for effect in load.effects:
                effect()
            outcome = load.outcome
            if outcome.cancelled:
                outcome.failed_block_ids = []  # its request is gone; vLLM frees its blocks now
            elif outcome.failed:
                self.state.failed_blocks.update(outcome.failed_block_ids)
                self.reads.log_failed_load(load.job, outcome)
            self.state.report.loads[load.job.request_id] = outcome
            finished.add(load.job.request_id)
            done.append((load.job, outcome))
        return finished, done

    def close(self, timeout_s: float) -> None:
        if self._loader is not None:
            self._loader.close(timeout_s)
            self._loader = None
