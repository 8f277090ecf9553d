"""Stores held back until every tensor-parallel rank has reported the loads they depend on.

Under tensor parallelism every rank's KV of a layer depends on every rank's attention output
of the layers before, so a chunk computed over a block whose load failed on any one rank is
wrong on every rank. A rank knows only its own failures when its step ends; the scheduler
learns them all from the workers' merged report of that step. So a store whose KV was
computed over blocks loaded in steps not yet reported (``after_loads``) is held on every
rank: its gather is made in its step (vLLM may reuse the blocks after), its writes wait.
When the report of the newest of those steps has been applied, the scheduler decides the
store once for every rank: withdrawn if any of those blocks failed to load on any rank, else
written. The decision goes to the workers in the next plan (``StepPlan.withdrawn``; the
others are written when a plan's ``reported_through`` reaches the store's ``settled_by``).
Until then a lookup does not see the chunk in the tiers it is held for, and no tier holds
it, so no engine, this one or a peer sharing its disk or Redis, can load it.

With one rank the worker knows every failure in its step and decides alone (nothing held).
Pure logic: no vLLM, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HeldStore:
    step: int  # the plan that stored it
    name: str
    tiers: tuple[str, ...]
    after_loads: frozenset[int]
    first_step: int  # the oldest step whose loads it depends on
    settled_by: int  # the newest one: its report settles the store


class HeldStores:
    def __init__(self) -> None:
        self._held: list[HeldStore] = []
        self._tiers: dict[str, set[str]] = {}  # chunk -> tiers a held store of it is for
        self._failed: dict[int, set[int]] = {}  # blocks that failed to load, by step
        self._withdrawn: list[tuple[int, str]] = []  # decided, for the next plan
        self.withdrawn_total = 0  # stores withdrawn for another rank's (or any rank's) failure

    def __len__(self) -> int:
        return len(self._held)

    def hold(
        self, step: int, name: str, tiers: Iterable[str], after_loads: Iterable[int], steps: Iterable[int]
    ) -> int:
        """A store of plan ``step`` computed over blocks loaded in ``steps`` (not reported yet);
        returns the step whose report settles it."""
        depends = sorted(steps)
        held = HeldStore(step, name, tuple(tiers), frozenset(after_loads), depends[0], depends[-1])
        self._held.append(held)
        self._tiers.setdefault(name, set()).update(held.tiers)
        return held.settled_by

    def hidden_in(self, name: str) -> set[str]:
        """The tiers a lookup must not find ``name`` in: a store of it there is held."""
        return self._tiers.get(name, set()) if self._tiers else set()

    def failed(self, step: int, blocks: Iterable[int]) -> None:
        """Blocks whose load in ``step`` failed on some rank (or that the plan failed itself)."""
        blocks = set(blocks)
        if blocks:
            self._failed.setdefault(step, set()).update(blocks)

    def reported(self, through: int) -> list[HeldStore]:
        """Every step up to ``through`` is reported (its failures given to ``failed`` first):
        settle the stores waiting for them; returns the ones withdrawn."""
        if not self._held:
            for step in [s for s in self._failed if s <= through]:
                del self._failed[step]
            return []
        withdrawn: list[HeldStore] = []
        waiting: list[HeldStore] = []
        for held in self._held:
            if held.settled_by > through:
                waiting.append(held)
                continue
            window = (
                b for s, bs in self._failed.items() if held.first_step <= s <= held.settled_by for b in bs
            )
            if not held.after_loads.isdisjoint(window):
                withdrawn.append(held)
                self._withdrawn.append((held.step, held.name))
        self._held = waiting
        self._tiers = {}
        for held in waiting:
            self._tiers.setdefault(held.name, set()).update(held.tiers)
        oldest = min((h.first_step for h in waiting), default=through + 1)
        for step in [s for s in self._failed if s < oldest]:
            del self._failed[step]
        self.withdrawn_total += len(withdrawn)
        return withdrawn

    def take_withdrawn(self) -> list[tuple[int, str]]:
        """(plan step, chunk) of the held stores withdrawn since the last call."""
        taken, self._withdrawn = self._withdrawn, []
        return taken
