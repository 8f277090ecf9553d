"""How fast each tier loads, measured from the loads it served: with the engine's measured
prefill cost per token, it says whether loading a chunk beats recomputing it.

A load's time (reads, checks and copies into vLLM's KV cache, on one rank) over its bytes,
averaged with exponential decay per tier so that it follows a tier that slows down or recovers.
A tier judged slower than recomputing is not loaded from, except once every ``recheck_s``, so
that a tier that got faster is measured again; that load's measurement replaces the decayed
average (a long slow spell would otherwise outweigh it for minutes of rechecks). Pure logic: no
vLLM, no torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class _Speed:
    seconds: float = 0.0  # decayed sums
    nbytes: float = 0.0
    loads: int = 0


class TierSpeeds:
    def __init__(
        self,
        half_life: float = 16.0,
        min_loads: int = 2,
        recheck_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._keep = 0.5 ** (1.0 / half_life)
        self._min_loads = min_loads
        self._recheck_s = recheck_s
        self._clock = clock
        self._tiers: dict[str, _Speed] = {}
        self._rechecked: dict[str, float] = {}
        self._remeasure: set[str] = set()  # tiers whose next load is a recheck's: a fresh start

    def observe(self, tier: str, nbytes: float, seconds: float) -> None:
        """One load from ``tier``: ``nbytes`` on one rank in ``seconds``."""
        if nbytes <= 0 or seconds <= 0:
            return
        if tier in self._remeasure:
            self._remeasure.discard(tier)
            self._tiers[tier] = _Speed(seconds, nbytes, self._min_loads)
            return
        s = self._tiers.setdefault(tier, _Speed())
        s.seconds = s.seconds * self._keep + seconds
        s.nbytes = s.nbytes * self._keep + nbytes
        s.loads += 1

    def seconds(self, tier: str, nbytes: float) -> float | None:
        """Predicted seconds to load ``nbytes`` from ``tier`` (None: not measured enough yet)."""
        s = self._tiers.get(tier)
        if s is None or s.loads < self._min_loads or s.nbytes <= 0:
            return None
        return nbytes * s.seconds / s.nbytes

    def bytes_per_second(self, tier: str) -> float | None:
        one = self.seconds(tier, 1.0)
        return 1.0 / one if one else None

    def recheck(self, tier: str) -> bool:
        """A tier found slow is loaded from anyway once every ``recheck_s`` (to measure it again)."""
        now = self._clock()
        if now - self._rechecked.setdefault(tier, now) < self._recheck_s:
            return False
        self._rechecked[tier] = now
        self._remeasure.add(tier)
        return True
