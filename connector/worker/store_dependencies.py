"""The worker's side of "never store KV computed over a failed load".

Two rules, one per thing a rank can know:
- Its own failures: a store that names (``StoreJob.after_loads``) a block whose load failed on
  this rank, in its step or in an earlier one whose report the scheduler had not processed
  when it planned the store, is withdrawn at once.
- Every rank's failures (tensor parallelism): a store the scheduler marked ``settled_by`` is
  gathered in its step and held here, written by no tier, until a plan's
  ``reported_through`` reaches ``settled_by``; then it is written, unless a plan listed it
  ``withdrawn`` (some rank's load it depends on failed). See ``engine/held_stores.py``.

Also the queue the worker's writes wait in, a step at a time (``StepWrites``). No vLLM here;
the held payloads are host memory the worker gathered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..engine.jobs import StepPlan, StoreJob
from ..engine.outcomes import FailureReason, StoreFailure

if TYPE_CHECKING:
    from .layer_copies import StepCopies


@dataclass(eq=False)
class StepWrites:
    """A step's evictions and stores, run in step order once its gathers are in host memory
    (at the step's end on CPU; on CUDA when the device has copied them, a step or so later)."""

    plan: StepPlan
    copies: StepCopies  # its gathers
    withdrawn: set[int]  # ids of store jobs computed over a failed load (decided in the step)
    names: set[str]  # chunks it writes: a later load of one of them waits for it
    on_device: bool  # its stores were gathered by a device's stream (the step is over when written)


@dataclass(eq=False)
class HeldWrite:
    step: int  # the plan that stored it
    job: StoreJob
    tiers: list[str]  # the usable tiers it goes to (an eviction of one of them drops it there)
    payload: memoryview
    data: Any  # the tensor behind ``payload`` (the payload pool may own it once written)


class StoreDependencies:
    def __init__(self) -> None:
        # This rank's failed blocks of recent steps, kept until the scheduler has their report.
        self._failed_by_step: dict[int, set[int]] = {}
        self._held: list[HeldWrite] = []
        self._withdrawn: set[tuple[int, str]] = set()  # verdicts received, until used
        self._reported_through = -1

    def __len__(self) -> int:
        """Stores held (they count as pending writes: the engine steps until they are settled)."""
        return len(self._held)

    def step_started(self, plan: StepPlan, step_failed: set[int]) -> None:
        """``step_failed``: the set this rank fills with the step's failed blocks."""
        for settled in [n for n in self._failed_by_step if n <= plan.reported_through]:
            del self._failed_by_step[settled]
        if plan.awaits_report:  # only steps with loads can fail one; their report always comes
            self._failed_by_step[plan.step] = step_failed
        self._reported_through = max(self._reported_through, plan.reported_through)
        self._withdrawn.update(plan.withdrawn)

    def over_failed_load(self, job: StoreJob) -> bool:
        """Computed over a block whose load failed on this rank."""
        return bool(job.after_loads) and any(
            not failed.isdisjoint(job.after_loads) for failed in self._failed_by_step.values()
        )

    def hold(self, step: int, job: StoreJob, tiers: list[str], payload: memoryview, data: Any) -> None:
        self._held.append(HeldWrite(step, job, tiers, payload, data))

    def drop(self, tier: str, name: str) -> None:
        """An eviction of ``name`` from ``tier`` comes after its held store: not written there."""
        for held in self._held:
            if held.job.name == name and tier in held.tiers:
                held.tiers.remove(tier)

    def settled(self, oldest_unwritten: int | None) -> tuple[list[HeldWrite], list[HeldWrite]]:
        """The held stores every rank's report has settled: (to write, withdrawn), in the
        order they were held. ``oldest_unwritten``: the step of the oldest plan whose writes
        are still queued (a store it holds later may still need a verdict)."""
        write: list[HeldWrite] = []
        withdrawn: list[HeldWrite] = []
        waiting: list[HeldWrite] = []
        for held in self._held:
            if held.job.settled_by > self._reported_through:
                waiting.append(held)
            elif (held.step, held.job.name) in self._withdrawn:
                withdrawn.append(held)
            else:
                write.append(held)
        self._held = waiting
        steps = [h.step for h in waiting] + ([oldest_unwritten] if oldest_unwritten is not None else [])
        oldest = min(steps, default=None)
        self._withdrawn = {v for v in self._withdrawn if oldest is not None and v[0] >= oldest}
        return write, withdrawn

    def write_settled(
        self,
        oldest_unwritten: int | None,
        write: Callable[[StoreJob, list[str], memoryview, Any], list[StoreFailure]],
    ) -> list[StoreFailure]:
        """Writes the settled held stores (``write(job, tiers, payload, data)``) and withdraws
        the others; the failures to report."""
        to_write, withdrawn = self.settled(oldest_unwritten)
        detail = "computed over a load that failed on some rank"
        failures = [
            StoreFailure(h.job.request_id, h.job.name, t, FailureReason.DEPENDENCY_FAILED, detail)
            for h in withdrawn
            for t in h.tiers
        ]
        for held in to_write:
            failures += write(held.job, held.tiers, held.payload, held.data)
        return failures

    def clear(self) -> None:
        """Shutdown: what is held is never written."""
        self._held = []
        self._withdrawn = set()
