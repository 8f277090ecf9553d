"""Retention: a request asks that the chunks it stores or hits be evicted last, for a while.

A request sends ``kvlens.retention_priority`` (1-3; 0 is normal) and/or ``kvlens.retain_for_s``
(seconds from the store or hit; a time alone means priority 1, a priority alone has no end)
in its ``kv_transfer_params``. A chunk keeps the highest priority and the latest end any
request gave it. A tier evicts its unretained chunks first, in its ``cache_policy`` order,
then retained ones, lowest priority and earliest end first. Retained bytes may not exceed
``max_retained_share`` of a tier's budget, nor one tenant's ``max_retained_share_per_tenant``:
the lowest (of that tenant) are demoted. Whether a request may retain at all, and how much, the
operator decides (``retention_rules.py``). A chunk past its end or
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
    tenant: str | None  # whose retained cap it counts against (None: none)


class RetentionBook:
    """The retained chunks of one tier: priority, end and size, the bytes per class, and the
    cap. The index asks it which keys to spare and in which order to take them last."""

    def __init__(
        self,
        capacity_bytes: int,
        max_share: float,
        clock: Callable[[], float],
        on_normal: Callable[[str], None] = lambda key: None,
        tenant_share: float = 1.0,
    ) -> None:
        self._cap_bytes = max_share * capacity_bytes
        self._tenant_cap_bytes = tenant_share * capacity_bytes
        self._tenant_bytes: dict[str, int] = {}
        self._tenant_ranks: dict[str, list[tuple[int, float, int, str]]] = {}  # as _ranks, per tenant
        self._tenant_entries = 0  # entries in the per-tenant heaps (stale ones too)
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

    def tenant_bytes(self, tenant: str) -> int:
        return self._tenant_bytes.get(tenant, 0)

    def retain(self, key: str, nbytes: int, retention: Retention, tenant: str | None = None) -> None:
        """Raise ``key``'s retention to at least ``retention`` (from now), then apply the caps.
        ``tenant``: whose retained cap the key counts against, from its first retention on."""
        until = math.inf if retention.seconds is None else self._clock() + retention.seconds
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = _Held(retention.priority, until, nbytes, tenant)
            self.retained_bytes[held.priority] += nbytes
            self._count(held.tenant, nbytes)
        else:
            if retention.priority <= held.priority and until <= held.until:
                return
            self.retained_bytes[held.priority] -= held.nbytes
            held.priority = max(held.priority, retention.priority)
            held.until = max(held.until, until)
            self.retained_bytes[held.priority] += held.nbytes
        rank = (held.priority, held.until, next(self._order), key)
        heapq.heappush(self._ranks, rank)
        if held.tenant is not None:
            heapq.heappush(self._tenant_ranks.setdefault(held.tenant, []), rank)
            self._tenant_entries += 1
        if held.until != math.inf:
            heapq.heappush(self._ends, (held.until, key))
        if max(len(self._ranks), self._tenant_entries) > 2 * len(self._held) + 64:  # drop stale entries
            self._compact()
        self._apply_cap()
        self._apply_tenant_cap(held.tenant)

    def forget(self, key: str) -> None:
        """``key`` left the tier, or became normal."""
        held = self._held.pop(key, None)
        if held is not None:
            self.retained_bytes[held.priority] -= held.nbytes
            self._count(held.tenant, -held.nbytes)

    def resize(self, key: str, nbytes: int) -> None:
        held = self._held.get(key)
        if held is not None:
            self.retained_bytes[held.priority] += nbytes - held.nbytes
            self._count(held.tenant, nbytes - held.nbytes)
            held.nbytes = nbytes

    def _count(self, tenant: str | None, delta: int) -> None:
        if tenant is None:
            return
        left = self._tenant_bytes.get(tenant, 0) + delta
        if left:
            self._tenant_bytes[tenant] = left
        else:  # nothing of it retained: its state goes
            self._tenant_bytes.pop(tenant, None)
            self._tenant_entries -= len(self._tenant_ranks.pop(tenant, ()))

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

    def _apply_tenant_cap(self, tenant: str | None) -> None:
        heap = self._tenant_ranks.get(tenant) if tenant is not None else None
        while heap and self._tenant_bytes.get(tenant, 0) > self._tenant_cap_bytes:  # type: ignore[arg-type]
            rank = heapq.heappop(heap)
            self._tenant_entries -= 1
            if self._current(rank):
                self.forget(rank[3])
                self.demotions += 1
                self._on_normal(rank[3])

    def _compact(self) -> None:
        self._ranks = [r for r in self._ranks if self._current(r)]
        heapq.heapify(self._ranks)
        self._tenant_ranks = {}
        for rank in self._ranks:
            tenant = self._held[rank[3]].tenant
            if tenant is not None:
                self._tenant_ranks.setdefault(tenant, []).append(rank)
        for heap in self._tenant_ranks.values():
            heapq.heapify(heap)
        self._tenant_entries = len(self._ranks) - sum(1 for h in self._held.values() if h.tenant is None)
        self._ends = [(h.until, k) for k, h in self._held.items() if h.until != math.inf]
        heapq.heapify(self._ends)
