"""The one interface every storage tier implements.

Payloads are opaque bytes (whole vLLM blocks of every layer of one chunk); tiers never
interpret them. A tier that cannot produce exactly what was stored raises ``ChunkMissing``
or ``ChunkCorrupt``: the worker turns either into failed blocks that vLLM recomputes.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


class ChunkMissing(LookupError):
    """The tier does not hold the chunk (evicted, deleted, never written)."""


class ChunkCorrupt(ValueError):
    """The tier holds something under that name, but not a valid copy of the chunk."""


@runtime_checkable
class Tier(Protocol):
    name: str

    def put(self, name: str, payload: memoryview) -> int:
        """Store ``payload`` under ``name``; returns the bytes written. Raises OSError on failure."""

    def get(self, name: str) -> memoryview:
        """The exact payload stored under ``name`` (writable), or ChunkMissing / ChunkCorrupt."""

    def delete(self, name: str) -> None:
        """Forget ``name``; a missing name is not an error."""

    def clear(self) -> None:
        """Forget everything this tier stored."""
