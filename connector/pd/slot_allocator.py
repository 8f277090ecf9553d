"""Slots of the PD receive buffer: best fit over free extents, at a cost holes do not raise.

The allocator runs under the buffer's lock, which every transfer's receiver thread takes and
whoever frees needs, so a step must not grow with the buffer's fragmentation. A peer re-sending
keys the decoder already holds makes holes (the resend lands in fresh slots that are freed at
indexing); the first fit this replaces scanned every hole for every slot, and with 20,000 holes
placing a 2,000-chunk transfer held the lock for 2 s (20,000 chunks: 22 s).

Free extents are kept by start and by end (dicts), and by size: a sorted list of the distinct
sizes, each with its extents. Every step is a few dict operations and one ``bisect``:

- the best fit is the smallest size that holds the slot (the extent freed last among those, its
  pages the warmest): small slots fill small holes and large extents stay for large records;
- freeing finds its neighbours by the end of the one before and the start of the one after and
  merges with them, so free space is always maximal extents and an empty buffer is one extent.

The one cost that grows is inserting or deleting a size in the sorted list of distinct sizes (a
``memmove`` of that list): sizes are few when records share a length, and at most about
``sqrt(2 * capacity / ALIGN)`` (distinct sizes that together fit the buffer), while the number of
holes does not count. Slots handed out are kept by offset, so a slot freed twice, never handed
out, or freed with another length is refused before any book changes.

A transfer's slots are allocated all or nothing: when one does not fit, those already taken are
freed again (merging restores the extents exactly), so a refused transfer holds nothing.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

ALIGN = 64  # each slot starts on a cache line


@dataclass(frozen=True, slots=True)
class Slot:
    offset: int
    length: int  # the record's bytes (the space taken is rounded up to ALIGN)


def span(length: int) -> int:
    """Bytes a record of ``length`` takes: rounded up to ALIGN, at least one ALIGN."""
    return max(ALIGN, -(-length // ALIGN) * ALIGN)


def space_needed(lengths: Sequence[int]) -> int:
    """Bytes of the buffer that slots of these lengths take (each rounded up to ALIGN)."""
    return sum(span(n) for n in lengths)


class SlotAllocator:
    """Best fit over maximal free extents, coalesced on free. Not thread-safe (the buffer locks)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._end_at: dict[int, int] = {}  # start of each free extent -> its end
        self._start_at: dict[int, int] = {}  # end of each free extent -> its start
        self._sizes: list[int] = []  # the distinct sizes of free extents, ascending
        self._of_size: dict[int, dict[int, None]] = {}  # size -> starts of the free extents of it
        self._taken: dict[int, int] = {}  # offset of each slot handed out -> its span
        if capacity > 0:
            self._add_extent(0, capacity)

    def allocate_all(self, lengths: Sequence[int]) -> list[Slot] | None:
        """A slot per length, or ``None`` (and nothing held) when they do not all fit now."""
        if space_needed(lengths) > self.capacity - self.used:
            return None
        slots: list[Slot] = []
        for n in lengths:
            slot = self._take(n)
            if slot is None:
                for s in slots:
                    self.free(s)
                return None
            slots.append(slot)
        return slots

    def free(self, slot: Slot) -> None:
        """Give a slot back; ``ValueError`` if it is not a slot this allocator handed out."""
        size = span(slot.length)
        if self._taken.get(slot.offset) != size:
            raise ValueError(f"slot {slot} freed twice (or never allocated with that length)")
        del self._taken[slot.offset]
        self.used -= size
        start, end = slot.offset, slot.offset + size
        if end in self._end_at:  # a free extent follows
            after = end
            end = self._end_at[after]
            self._remove_extent(after, end)
        if start in self._start_at:  # a free extent precedes
            before = self._start_at[start]
            self._remove_extent(before, start)
            start = before
        self._add_extent(start, end)

    def free_extents(self) -> list[tuple[int, int]]:
        """The free ``(start, end)`` extents by start (for checks and diagnostics)."""
        return sorted(self._end_at.items())

    def _take(self, length: int) -> Slot | None:
        need = span(length)
        k = bisect.bisect_left(self._sizes, need)
        if k == len(self._sizes):
            return None
        size = self._sizes[k]
        start, _ = self._of_size[size].popitem()  # the extent of that size freed last (O(1))
        self._forget(start, start + size)
        if size > need:
            self._add_extent(start + need, start + size)
        self._taken[start] = need
        self.used += need
        return Slot(start, length)

    def _add_extent(self, start: int, end: int) -> None:
        self._end_at[start] = end
        self._start_at[end] = start
        size = end - start
        if size not in self._of_size:
            self._of_size[size] = {}
            bisect.insort(self._sizes, size)
        self._of_size[size][start] = None

    def _remove_extent(self, start: int, end: int) -> None:
        del self._of_size[end - start][start]
        self._forget(start, end)

    def _forget(self, start: int, end: int) -> None:
        """Drop an extent, already out of its size's starts, from the other books."""
        del self._end_at[start], self._start_at[end]
        size = end - start
        if not self._of_size[size]:
            del self._of_size[size]
            del self._sizes[bisect.bisect_left(self._sizes, size)]
