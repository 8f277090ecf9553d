"""Buffers of chunks the CPU tier dropped, reused by the next stores.

A store copies a chunk's blocks into a new buffer that the CPU tier then keeps; fresh memory
costs a page fault per 4 KiB page, which makes a store several times slower than a copy
into memory already touched (bench/tier_bandwidth.py). Once the tier is full every store
evicts about as many bytes as it adds, so the dropped buffers feed the next gathers.

A buffer is reused only when nothing else can still read it: it was gathered for a store
that went to the CPU tier alone (a disk or remote write may still hold a payload shared with
another tier), the tier dropped it, and no load holds a lease on it. Every load takes a
lease on the CPU-tier views it reads (``lease``) and closes it once its copies are done: a
load in the step at the step's end, an asynchronous load, which reads on its own thread
while the step thread may drop the chunk (a clear, a chunk forgotten), when it finishes. A
buffer dropped while leased returns to the pool when its last lease closes. On CUDA the
buffers are page-locked (the device gathers into them) and every copy to or from them runs
in order on KVLens's one copy stream, so a reused buffer is written only after the loads
that read it. Buffers are kept per shape, up in the room ``room()`` says is left
(``engine/cpu_budget.py``); beyond that they are freed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class PayloadPool:
    def __init__(self, room: Callable[[], int]) -> None:
        self._room = room  # bytes the pool may hold now
        self.bytes = 0  # held for reuse
        self._free: dict[tuple[int, ...], list[torch.Tensor]] = {}
        self._owned: dict[int, torch.Tensor] = {}  # id of a view the CPU tier holds -> its buffer
        self._leases: dict[int, int] = {}  # id of a view -> leases held on it
        self._dropped_leased: dict[int, tuple[memoryview, torch.Tensor]] = {}  # reused once let go
        self._lock = threading.Lock()  # leases close on the asynchronous-load thread

    def take(self, shape: tuple[int, ...]) -> torch.Tensor | None:
        """A dropped buffer of ``shape`` to gather into, or None."""
        with self._lock:
            free = self._free.get(shape)
            if not free:
                return None
            buffer = free.pop()
            self.bytes -= buffer.nbytes
            return buffer

    def own(self, view: memoryview, buffer: torch.Tensor) -> None:
        """The CPU tier keeps ``view`` of ``buffer``, and nothing else reads it: reusable once dropped."""
        with self._lock:
            self._owned[id(view)] = buffer

    def dropped(self, view: memoryview) -> None:
        """The CPU tier no longer holds ``view`` (called while the view is still alive)."""
        with self._lock:
            buffer = self._owned.pop(id(view), None)
            if buffer is None:
                return
            if id(view) in self._leases:  # a load still reads it: kept (and the view alive) till then
                self._dropped_leased[id(view)] = (view, buffer)
            else:
                self._keep(buffer)

    def lease(self) -> ViewLease:
        """A load's hold on the CPU-tier views it reads (``ViewLease.hold``), until ``close``."""
        return ViewLease(self)

    def _hold(self, view: memoryview) -> None:
        with self._lock:
            self._leases[id(view)] = self._leases.get(id(view), 0) + 1

    def _let_go(self, view: memoryview) -> None:
        with self._lock:
            left = self._leases.pop(id(view), 1) - 1
            if left:
                self._leases[id(view)] = left
                return
            dropped = self._dropped_leased.pop(id(view), None)
            if dropped is not None:
                self._keep(dropped[1])

    def _keep(self, buffer: torch.Tensor) -> None:
        if self.bytes + buffer.nbytes <= self._room():
            self._free.setdefault(tuple(buffer.shape), []).append(buffer)
            self.bytes += buffer.nbytes

    def trim(self) -> None:
        """Free kept buffers until they fit the room left (after the tier took new memory)."""
        with self._lock:
            room = self._room()
            for free in self._free.values():
                while free and self.bytes > room:
                    self.bytes -= free.pop().nbytes
            self._free = {shape: free for shape, free in self._free.items() if free}

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._owned.clear()
            self._dropped_leased.clear()
            self.bytes = 0


class ViewLease:
    """The views one load reads: none of their buffers is reused before ``close``."""

    def __init__(self, pool: PayloadPool) -> None:
        self._pool = pool
        self._views: list[memoryview] = []

    def read(self, tier: Any, name: str) -> memoryview | BaseException:
        """``tier.get(name)``, held (a failed read is returned, for the caller to classify)."""
        try:
            view = tier.get(name)
        except Exception as e:  # noqa: BLE001 - a failed read is a value
            return e
        self.hold(view)  # a view no tier gave the pool is held at no cost but a count
        return view

    def hold(self, view: memoryview) -> None:
        self._pool._hold(view)
        self._views.append(view)

    def close(self) -> None:
        """The load's copies are done (or given up); closing again does nothing."""
        views, self._views = self._views, []
        for view in views:
            self._pool._let_go(view)
