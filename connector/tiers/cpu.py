"""CPU-memory tier: payloads kept in this worker's memory.

The scheduler's index decides what is admitted and evicted (budget, LRU, pins); this class
only holds bytes, so it is as cheap as a dict.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .base import ChunkMissing


class CpuTier:
    name = "cpu"

    def __init__(self, on_drop: Callable[[memoryview], None] | None = None) -> None:
        self._chunks: dict[str, memoryview] = {}
        self.used_bytes = 0
        self._on_drop = on_drop  # told of every payload the tier stops holding (buffer reuse)

    def __len__(self) -> int:
        return len(self._chunks)

    def put(self, name: str, payload: memoryview, namespace: str = "") -> int:
        old = self._chunks.get(name)
        if old is not None and _same_memory(old, payload):
            return payload.nbytes  # already held: dropping it would hand a buffer in use to reuse
        self.delete(name)
        self._chunks[name] = payload
        self.used_bytes += payload.nbytes
        return payload.nbytes

    def get(self, name: str) -> memoryview:
        try:
            return self._chunks[name]
        except KeyError:
            raise ChunkMissing(name) from None

    def delete(self, name: str) -> None:
        old = self._chunks.pop(name, None)
        if old is not None:
            self.used_bytes -= old.nbytes
            if self._on_drop is not None:
                self._on_drop(old)

    def clear(self) -> None:
        for name in list(self._chunks):
            self.delete(name)


def _same_memory(a: memoryview, b: memoryview) -> bool:
    """Two views of the same bytes (the same object, or views of one buffer's memory)."""
    if a is b:
        return True
    if a.nbytes != b.nbytes or a.nbytes == 0:
        return False
    return _address(a) == _address(b)


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0]
