"""The scheduler's view of what each tier holds: eviction order, byte budget and pins.

The scheduler owns this index and is the only one that decides what is stored and
evicted; workers carry out those decisions in the order the scheduler issued them.
That is what makes a lookup agree with what the later load finds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .eviction import make_order
from .retention import Retention, RetentionBook


@dataclass(slots=True)
class Entry:
    nbytes: int
    pins: int = 0
    tenant: str | None = None  # whose quota it counts against (None: another engine's, unknown)


class TierIndex:
    """Keys of one tier within a byte budget, evicted in the order of ``policy`` (LMCache's
    ``cache_policy``: LRU, LFU, FIFO or MRU); pinned keys are never evicted. Retained keys
    (``retention.py``) go after all others; with ``tenant_quota``, a tenant's keys beyond it
    make room by evicting that tenant's own keys only."""

    def __init__(
        self,
        name: str,
        capacity_bytes: int,
        on_drop: Callable[[str], None] | None = None,
        policy: str = "LRU",
        max_retained_share: float = 0.5,
        tenant_quota: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_retained_share_per_tenant: float = 1.0,
    ) -> None:
        self.name = name
        self.capacity_bytes = capacity_bytes
        self._order = make_order(policy)
        self.policy = policy.upper()
        self._on_drop = on_drop  # told every key that leaves (evicted, removed, cleared)
        self._entries: dict[str, Entry] = {}
        self._used = 0
        self._pinned_keys = 0
        self._pinned_bytes = 0
        self.evictions = 0
        # Retained keys leave the policy's order (so that a walk for victims never passes over
        # them) and return to it as the first to evict when their retention ends.
        self.retention = RetentionBook(
            capacity_bytes,
            max_retained_share,
            clock,
            lambda key: self._order.add(key, False),
            max_retained_share_per_tenant,
        )
        self.tenant_quota = tenant_quota
        self._tenant_bytes: dict[str, int] = {}
        self.retained_evictions = 0  # evictions that had to take a retained key
        self.quota_evictions = 0  # keys a tenant over its quota evicted of its own
        self.quota_refusals = 0  # keys not admitted: their tenant's own keys could not make room

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def also_on_drop(self, callback: Callable[[str], None]) -> None:
        """Tell ``callback`` too of every key that leaves (after the callback given before)."""
        first = self._on_drop
        if first is None:
            self._on_drop = callback
            return

        def both(key: str) -> None:
            first(key)
            callback(key)

        self._on_drop = both

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def pinned_keys(self) -> int:
        return self._pinned_keys

    @property
    def pinned_bytes(self) -> int:
        return self._pinned_bytes

    def keys(self) -> list[str]:
        """Every key, first to be evicted first (pinned ones included)."""
        return [*self._order.candidates(), *self.retention.last_resort()]

    def touch(self, key: str) -> None:
        """A use of ``key`` (a hit loaded, a store of a chunk already held): LRU and MRU move
        it to the recent end, LFU counts it, FIFO ignores it."""
        if key in self._entries:
            self._order.use(key)

    def admit(
        self, key: str, nbytes: int, retention: Retention | None = None, tenant: str | None = None
    ) -> list[str] | None:
        """Add ``key`` (or raise its retention), evicting unpinned keys to make room: first the
        tenant's own beyond its quota, then any, unretained in the policy's order before retained.

        Returns the evicted keys (possibly none), or None when the key cannot fit even
        after evicting everything it may; nothing is evicted in that case.
        """
        if key in self._entries:
            self._order.use(key)
            self.retain(key, retention)
            return []
        if nbytes > self.capacity_bytes:
            return None
        self.retention.expire()
        victims: list[str] = []
        freed = 0
        quota = self.tenant_quota if tenant is not None else None
        if quota is not None:
            over = self._tenant_bytes.get(tenant, 0) + nbytes - quota  # type: ignore[arg-type]
            if over > 0:
                freed = self._choose(victims, over, tenant)
                if freed < over:
                    self.quota_refusals += 1
                    return None
        own = len(victims)
        need = self._used - freed + nbytes - self.capacity_bytes
        if need > 0 and self._choose(victims, need) < need:
            return None
        self.quota_evictions += own
        self._evict(victims)
        self._entries[key] = Entry(nbytes, tenant=tenant)
        self._order.add(key)
        self._used += nbytes
        self._count_tenant(tenant, nbytes)
        self.retain(key, retention)
        return victims

    def retain(self, key: str, retention: Retention | None) -> None:
        """A request that stores or hits ``key`` asks it to be kept (None: asks nothing)."""
        entry = self._entries.get(key)
        if retention is None or entry is None:
            return
        if key not in self.retention:
            self._order.discard(key)
        self.retention.retain(key, entry.nbytes, retention, entry.tenant)

    def bytes_by_class(self) -> tuple[int, ...]:
        """Bytes held per retention priority, 0 (normal) first."""
        self.retention.expire()
        retained = self.retention.retained_bytes
        return (self._used - sum(retained), *retained[1:])

    def tenant_bytes(self, tenant: str) -> int:
        return self._tenant_bytes.get(tenant, 0)

    def _choose(self, victims: list[str], need: int, tenant: str | None = None) -> int:
        """Append to ``victims`` unpinned keys (of ``tenant``, if given) not chosen yet, until
        they free ``need`` bytes: unretained in the policy's order, then retained; bytes freed."""
        chosen = set(victims)
        freed = 0
        retained = self.retention
        for last_resort in (False, True):
            keys = retained.last_resort() if last_resort else self._order.candidates()
            for k in keys:
                if freed >= need:
                    return freed
                e = self._entries[k]
                if e.pins or k in chosen:
                    continue
                if tenant is not None and e.tenant != tenant:
                    continue
                victims.append(k)
                freed += e.nbytes
        return freed

    def _evict(self, victims: list[str]) -> None:
        self.retained_evictions += sum(1 for k in victims if k in self.retention)
        for k in victims:
            self._drop(k)
        self.evictions += len(victims)

    def _count_tenant(self, tenant: str | None, nbytes: int) -> None:
        if tenant is None:
            return
        left = self._tenant_bytes.get(tenant, 0) + nbytes
        if left:
            self._tenant_bytes[tenant] = left
        else:
            self._tenant_bytes.pop(tenant, None)

    def add_known(self, key: str, nbytes: int, most_recent: bool = False) -> None:
        """Record a key found in the store (another engine wrote it): the first to evict
        (``most_recent=False``: old, unused here) or ranked as if just stored."""
        if key in self._entries:
            return
        self._entries[key] = Entry(nbytes)
        self._order.add(key, most_recent)
        self._used += nbytes

    def remove(self, key: str) -> bool:
        if key not in self._entries:
            return False
        self._drop(key)
        return True

    def overflow_victims(self) -> list[str]:
        """Unpinned keys, in eviction order, to drop so that usage fits the budget (after add_known)."""
        victims: list[str] = []
        excess = self._used - self.capacity_bytes
        if excess > 0:
            self.retention.expire()
            self._choose(victims, excess)
            self._evict(victims)
        return victims

    def pin(self, key: str) -> bool:
        return self.hold(key) is not None

    def hold(self, key: str) -> Entry | None:
        """Pin ``key``; the entry pinned, to hand back to ``unpin`` (None: not stored)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.pins == 0:
            self._pinned_keys += 1
            self._pinned_bytes += entry.nbytes
        entry.pins += 1
        return entry

    def unpin(self, key: str, entry: Entry | None = None) -> None:
        """Drop one pin of ``key``; given ``entry``, only while that entry is still the one stored.

        A pinned key can be removed (a failed load, another engine deleted it) and stored
        again; the old pin must not release the pin a later request took on the new entry.
        """
        current = self._entries.get(key)
        if current is None or current.pins == 0 or (entry is not None and current is not entry):
            return
        current.pins -= 1
        if current.pins == 0:
            self._pinned_keys -= 1
            self._pinned_bytes -= current.nbytes

    def update_size(self, key: str, nbytes: int) -> None:
        entry = self._entries.get(key)
        if entry is None or entry.nbytes == nbytes:
            return
        self._used += nbytes - entry.nbytes
        self._count_tenant(entry.tenant, nbytes - entry.nbytes)
        self.retention.resize(key, nbytes)
        if entry.pins:
            self._pinned_bytes += nbytes - entry.nbytes
        entry.nbytes = nbytes

    def clear(self) -> list[str]:
        """Drop every unpinned key (a cache reset); returns what was dropped."""
        dropped = [k for k in self.keys() if self._entries[k].pins == 0]
        for k in dropped:
            self._drop(k)
        return dropped

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key)
        self._order.discard(key)
        self._used -= entry.nbytes
        self._count_tenant(entry.tenant, -entry.nbytes)
        self.retention.forget(key)
        if entry.pins:
            self._pinned_keys -= 1
            self._pinned_bytes -= entry.nbytes
        if self._on_drop is not None:
            self._on_drop(key)


class PinTable:
    """Which (tier, key) pins each request holds, so release is exact and idempotent."""

    def __init__(self) -> None:
        self._by_request: dict[str, list[tuple[TierIndex, str, Entry]]] = {}

    def __len__(self) -> int:
        return len(self._by_request)

    def pin(self, request_id: str, pins: Iterable[tuple[TierIndex, str]]) -> None:
        self.release(request_id)
        held = [(tier, key, entry) for tier, key in pins if (entry := tier.hold(key)) is not None]
        if held:
            self._by_request[request_id] = held

    def add(self, request_id: str, pins: Iterable[tuple[TierIndex, str]]) -> None:
        """More pins for ``request_id``, released with the ones it holds."""
        held = [(tier, key, entry) for tier, key in pins if (entry := tier.hold(key)) is not None]
        if held:
            self._by_request.setdefault(request_id, []).extend(held)

    def release(self, request_id: str) -> int:
        held = self._by_request.pop(request_id, [])
        for tier, key, entry in held:
            tier.unpin(key, entry)
        return len(held)

    def holds(self, request_id: str) -> bool:
        return request_id in self._by_request

    def requests(self) -> list[str]:
        return list(self._by_request)
