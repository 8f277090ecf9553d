"""Buffers of chunks the CPU tier dropped, reused by the next stores.

A store copies a chunk's blocks into a new buffer that the CPU tier then keeps; fresh memory
costs a page fault per 4 KiB page, which makes a store several times slower than a copy
into memory already touched (bench/tier_bandwidth.py). Once the tier is full every store
evicts about as many bytes as it adds, so the dropped buffers feed the next gathers.

A buffer is reused only when nothing else can still read it: it was gathered for a store
that went to the CPU tier alone (a disk or remote write may still hold a payload shared with
another tier), and the worker drops it only when it makes a step's evictions, after every
load of that step has been copied. On CUDA the buffers are page-locked (the device gathers
into them) and every copy to or from them runs in order on KVLens's one copy stream, so a
reused buffer is written only after the loads that read it. Buffers are kept per shape, up
in the room ``room()`` says is left (``engine/cpu_budget.py``); beyond that they are freed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class PayloadPool:
    def __init__(self, room: Callable[[], int]) -> None:
        self._room = room  # bytes the pool may hold now
        self.bytes = 0  # held for reuse
        self._free: dict[tuple[int, ...], list[torch.Tensor]] = {}
        self._owned: dict[int, torch.Tensor] = {}  # id of a view the CPU tier holds -> its buffer

    def take(self, shape: tuple[int, ...]) -> torch.Tensor | None:
        """A dropped buffer of ``shape`` to gather into, or None."""
        free = self._free.get(shape)
        if not free:
            return None
        buffer = free.pop()
        self.bytes -= buffer.nbytes
        return buffer

    def own(self, view: memoryview, buffer: torch.Tensor) -> None:
        """The CPU tier keeps ``view`` of ``buffer``, and nothing else reads it: reusable once dropped."""
        self._owned[id(view)] = buffer

    def dropped(self, view: memoryview) -> None:
        """The CPU tier no longer holds ``view`` (called while the view is still alive)."""
        buffer = self._owned.pop(id(view), None)
        if buffer is None or self.bytes + buffer.nbytes > self._room():
            return
        self._free.setdefault(tuple(buffer.shape), []).append(buffer)
        self.bytes += buffer.nbytes

    def trim(self) -> None:
        """Free kept buffers until they fit the room left (after the tier took new memory)."""
        room = self._room()
        for free in self._free.values():
            while free and self.bytes > room:
                self.bytes -= free.pop().nbytes
        self._free = {shape: free for shape, free in self._free.items() if free}

    def clear(self) -> None:
        self._free.clear()
        self._owned.clear()
        self.bytes = 0
