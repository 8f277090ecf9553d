"""Retention: a request asks that the chunks it stores or hits be evicted last, for a while.

A request sends ``kvlens.retention_priority`` (1-3; 0 is normal) and/or ``kvlens.retain_for_s``
(seconds from the store or hit; a time alone means priority 1, a priority alone has no end)
in its ``kv_transfer_params``. A chunk keeps the highest priority and the latest end any
request gave it. A tier evicts its unretained chunks first, in its ``cache_policy`` order,
then retained ones, lowest priority and earliest end first. Retained bytes may not exceed
``max_retained_share`` of a tier's budget: the lowest are demoted. A chunk past its end or
demoted stays stored, as a normal chunk and the first one to evict. LMCache has no such
parameter, hence the ``kvlens.`` prefix. Only the tiers KVLens evicts (CPU, disk) retain;
Redis evicts by itself.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

PRIORITY_PARAM = "kvlens.retention_priority"
SECONDS_PARAM = "kvlens.retain_for_s"
PARAMS = frozenset({PRIORITY_PARAM, SECONDS_PARAM})
MAX_PRIORITY = 3
CLASSES = tuple(str(p) for p in range(MAX_PRIORITY + 1))  # metric label values: "0" is normal
MAX_SECONDS = 30 * 86400.0


@dataclass(frozen=True, slots=True)
class Retention:
    """What a request asks for its chunks."""

    priority: int  # 1..MAX_PRIORITY
    seconds: float | None  # None: retained until evicted as the last resort or demoted by the cap


def parse_retention(params: Mapping[str, Any]) -> Retention | None:
    """The request's retention (None: none asked); ValueError names the bad parameter."""
    priority, seconds = params.get(PRIORITY_PARAM), params.get(SECONDS_PARAM)
    if priority is None and seconds is None:
        return None
    if priority is not None and (
        isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= MAX_PRIORITY
    ):
        raise ValueError(f"{PRIORITY_PARAM} must be an integer 0-{MAX_PRIORITY}, got {_show(priority)}")
    if seconds is not None and (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not 0 < seconds <= MAX_SECONDS
        or math.isnan(seconds)
    ):
        raise ValueError(f"{SECONDS_PARAM} must be seconds in (0, {MAX_SECONDS:g}], got {_show(seconds)}")
    if priority == 0:
        return None
    return Retention(priority or 1, float(seconds) if seconds is not None else None)


def _show(value: Any) -> str:
    if isinstance(value, bool | float) or (isinstance(value, int) and abs(value) < 10**12):
        return repr(value)
    return f"a {type(value).__name__}"


@dataclass(slots=True)
class _Held:
    priority: int
    until: float  # math.inf: no end
    nbytes: int


class RetentionBook:
    """The retained chunks of one tier: priority, end and size, the bytes per class, and the
    cap. The index asks it which keys to spare and in which order to take them last."""

    def __init__(
        self,
        capacity_bytes: int,
        max_share: float,
        clock: Callable[[], float],
        on_normal: Callable[[str], None] = lambda key: None,
    ) -> None:
        self._cap_bytes = max_share * capacity_bytes
        self._clock = clock
        self._on_normal = on_normal  # told each key that expired or was demoted (still stored)
        self._held: dict[str, _Held] = {}
        self._ends: list[tuple[float, str]] = []  # heap of (end, key); stale entries skipped
        # Heap of (priority, end, order, key), lowest first: a key's rank only rises, so an entry
        # that no longer matches its key's rank is stale and skipped.
        self._ranks: list[tuple[int, float, int, str]] = []
        self._order = itertools.count()
        self.retained_bytes = [0] * (MAX_PRIORITY + 1)  # index 0 unused (normal = used - retained)
        self.demotions = 0  # chunks made normal by the cap

    def __contains__(self, key: str) -> bool:
        return key in self._held

    def __len__(self) -> int:
        return len(self._held)

    def total_bytes(self) -> int:
        return sum(self.retained_bytes)

    def priority(self, key: str) -> int:
        held = self._held.get(key)
        return held.priority if held is not None else 0

    def retain(self, key: str, nbytes: int, retention: Retention) -> None:
        """Raise ``key``'s retention to at least ``retention`` (from now), then apply the cap."""
        until = math.inf if retention.seconds is None else self._clock() + retention.seconds
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = _Held(retention.priority, until, nbytes)
            self.retained_bytes[held.priority] += nbytes
        else:
            if retention.priority <= held.priority and until <= held.until:
                return
            self.retained_bytes[held.priority] -= held.nbytes
            held.priority = max(held.priority, retention.priority)
            held.until = max(held.until, until)
            self.retained_bytes[held.priority] += held.nbytes
        heapq.heappush(self._ranks, (held.priority, held.until, next(self._order), key))
        if held.until != math.inf:
            heapq.heappush(self._ends, (held.until, key))
        if len(self._ranks) > 2 * len(self._held) + 64:  # renewed ranks and ends: drop stale entries
            self._compact()
        self._apply_cap()

    def forget(self, key: str) -> None:
        """``key`` left the tier, or became normal."""
        held = self._held.pop(key, None)
        if held is not None:
            self.retained_bytes[held.priority] -= held.nbytes

    def resize(self, key: str, nbytes: int) -> None:
        held = self._held.get(key)
        if held is not None:
            self.retained_bytes[held.priority] += nbytes - held.nbytes
            held.nbytes = nbytes

    def expire(self) -> None:
        """Chunks whose end has passed become normal."""
        now = self._clock()
        while self._ends and self._ends[0][0] <= now:
            until, key = heapq.heappop(self._ends)
            held = self._held.get(key)
            if held is not None and held.until == until:
                self.forget(key)
                self._on_normal(key)

    def last_resort(self) -> Iterator[str]:
        """Retained keys in the order they are taken when nothing else is left: lowest
        priority, then earliest end, then first ranked. Do not retain or forget while iterating."""
        heap, seen = list(self._ranks), set()
        while heap:
            rank = heapq.heappop(heap)
            if self._current(rank) and rank[3] not in seen:  # a key stored again ranks twice
                seen.add(rank[3])
                yield rank[3]

    def _current(self, rank: tuple[int, float, int, str]) -> bool:
        held = self._held.get(rank[3])
        return held is not None and held.priority == rank[0] and held.until == rank[1]

    def _apply_cap(self) -> None:
        while self.total_bytes() > self._cap_bytes and self._ranks:
            rank = heapq.heappop(self._ranks)
            if self._current(rank):
                self.forget(rank[3])
                self.demotions += 1
                self._on_normal(rank[3])

    def _compact(self) -> None:
        self._ranks = [r for r in self._ranks if self._current(r)]
        heapq.heapify(self._ranks)
        self._ends = [(h.until, k) for k, h in self._held.items() if h.until != math.inf]
        heapq.heapify(self._ends)
