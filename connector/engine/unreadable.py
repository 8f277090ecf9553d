"""Chunks whose load just failed (missing or damaged), per tier: lookups pass over them for a while.

A tier without an index of its own (the remote: a lookup asks Redis whether a key exists) would
offer a damaged value again at once, and vLLM asks again right after an asynchronous load failed:
the request would load the same bad value forever. A local tier's index forgets the chunk, but a
rescan of a shared directory may bring the file back before its engine deletes it. So for
``ttl_s`` after a failure, lookups treat the chunk as absent from that tier (a recompute stores a
good copy meanwhile). Pure logic: no vLLM, no torch.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class UnreadableChunks:
    def __init__(
        self, ttl_s: float = 10.0, max_chunks: int = 65_536, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._ttl_s = ttl_s
        self._max = max_chunks
        self._clock = clock
        self._until: OrderedDict[tuple[str, str], float] = OrderedDict()  # oldest first
        self._names: dict[str, int] = {}  # chunk -> tiers it is unreadable in (a fast first check)

    def __len__(self) -> int:
        return len(self._until)

    def add(self, tier: str, name: str) -> None:
        key = (tier, name)
        if key not in self._until:
            self._names[name] = self._names.get(name, 0) + 1
        self._until[key] = self._clock() + self._ttl_s
        self._until.move_to_end(key)
        while len(self._until) > self._max:
            self._drop(next(iter(self._until)))

    def discard(self, tier: str, name: str) -> None:
        """The tier is given a fresh copy (a store or a promotion): readable again."""
        if (tier, name) in self._until:
            self._drop((tier, name))

    def tier_recovered(self, tier: str) -> None:
        """The tier works again after it was skipped: what failed there while it was broken is
        offered again at once (a load then finds each chunk as it really is)."""
        for key in [k for k in self._until if k[0] == tier]:
            self._drop(key)

    def unreadable(self, tier: str, name: str) -> bool:
        if name not in self._names:
            return False
        until = self._until.get((tier, name))
        if until is None:
            return False
        if until <= self._clock():
            self._drop((tier, name))
            return False
        return True

    def any_tier(self, name: str) -> bool:
        """Unreadable in some tier (check each with ``unreadable``)."""
        return name in self._names

    def _drop(self, key: tuple[str, str]) -> None:
        del self._until[key]
        left = self._names[key[1]] - 1
        if left:
            self._names[key[1]] = left
        else:
            del self._names[key[1]]
