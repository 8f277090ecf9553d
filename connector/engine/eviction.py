"""Eviction orders for a tier index: which unpinned chunk goes first (LMCache's ``cache_policy``).

Each order only ranks keys; the index owns sizes, budgets and pins and walks ``candidates()``
until enough unpinned bytes are found. Every operation is O(1) (LFU included: frequencies live
in a linked list of buckets, each bucket in least-recently-reached order, so a use moves a key
one bucket up without a search), because a lookup touches every chunk it hits.

- LRU: least recently used first (a use moves a key to the back).
- MRU: most recently used first (same order as LRU, evicted from the other end).
- FIFO: oldest stored first; uses do not reorder.
- LFU: fewest uses first; among equal counts, the one that reached that count first
  (LMCache's LFU keeps insertion order within a frequency too).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol

POLICIES = ("LRU", "LFU", "FIFO", "MRU")


class EvictionOrder(Protocol):
    def add(self, key: str, most_recent: bool = True) -> None:
        """A new key: the most recent one, or (``most_recent=False``) the oldest, least used."""

    def use(self, key: str) -> None:
        """The key was read or stored again."""

    def discard(self, key: str) -> None:
        """The key left the tier (evicted, removed, cleared)."""

    def candidates(self) -> Iterator[str]:
        """Every key, first to evict first. Do not add, use or discard while iterating."""


def make_order(policy: str) -> EvictionOrder:
    """The order for an LMCache ``cache_policy`` name, in any case."""
    name = policy.upper() if isinstance(policy, str) else policy
    if name == "LRU":
        return RecencyOrder(evict_newest=False, reorder_on_use=True)
    if name == "MRU":
        return RecencyOrder(evict_newest=True, reorder_on_use=True)
    if name == "FIFO":
        return RecencyOrder(evict_newest=False, reorder_on_use=False)
    if name == "LFU":
        return FrequencyOrder()
    raise ValueError(f"cache_policy {policy!r} is not one of {', '.join(POLICIES)}")


class RecencyOrder:
    """LRU, MRU and FIFO: one ordered dict, oldest at the front."""

    __slots__ = ("_keys", "_evict_newest", "_reorder_on_use")

    def __init__(self, evict_newest: bool, reorder_on_use: bool) -> None:
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._evict_newest = evict_newest
        self._reorder_on_use = reorder_on_use

    def add(self, key: str, most_recent: bool = True) -> None:
        self._keys[key] = None
        if not most_recent:
            self._keys.move_to_end(key, last=False)

    def use(self, key: str) -> None:
        if self._reorder_on_use and key in self._keys:
            self._keys.move_to_end(key)

    def discard(self, key: str) -> None:
        self._keys.pop(key, None)

    def candidates(self) -> Iterator[str]:
        return reversed(self._keys) if self._evict_newest else iter(self._keys)


class _Bucket:
    __slots__ = ("count", "keys", "prev", "next")

    def __init__(self, count: int) -> None:
        self.count = count
        self.keys: OrderedDict[str, None] = OrderedDict()
        self.prev: _Bucket | None = None
        self.next: _Bucket | None = None


class FrequencyOrder:
    """LFU: buckets of equal use counts in ascending order; a key's count starts at 1."""

    __slots__ = ("_head", "_bucket_of")

    def __init__(self) -> None:
        self._head: _Bucket | None = None
        self._bucket_of: dict[str, _Bucket] = {}

    def add(self, key: str, most_recent: bool = True) -> None:
        if key in self._bucket_of:
            return
        head = self._head
        if head is None or head.count != 1:
            head = self._insert_after(None, 1)
        head.keys[key] = None
        if not most_recent:
            head.keys.move_to_end(key, last=False)
        self._bucket_of[key] = head

    def use(self, key: str) -> None:
        bucket = self._bucket_of.get(key)
        if bucket is None:
            return
        up = bucket.next
        if up is None or up.count != bucket.count + 1:
            up = self._insert_after(bucket, bucket.count + 1)
        del bucket.keys[key]
        up.keys[key] = None
        self._bucket_of[key] = up
        if not bucket.keys:
            self._unlink(bucket)

    def discard(self, key: str) -> None:
        bucket = self._bucket_of.pop(key, None)
        if bucket is not None:
            del bucket.keys[key]
            if not bucket.keys:
                self._unlink(bucket)

    def candidates(self) -> Iterator[str]:
        bucket = self._head
        while bucket is not None:
            yield from bucket.keys
            bucket = bucket.next

    def count(self, key: str) -> int:
        """How many times ``key`` was stored or used (0: not held)."""
        bucket = self._bucket_of.get(key)
        return bucket.count if bucket is not None else 0

    def _insert_after(self, bucket: _Bucket | None, count: int) -> _Bucket:
        new = _Bucket(count)
        after = self._head if bucket is None else bucket.next
        new.prev, new.next = bucket, after
        if after is not None:
            after.prev = new
        if bucket is None:
            self._head = new
        else:
            bucket.next = new
        return new

    def _unlink(self, bucket: _Bucket) -> None:
        if bucket.prev is None:
            self._head = bucket.next
        else:
            bucket.prev.next = bucket.next
        if bucket.next is not None:
            bucket.next.prev = bucket.prev
