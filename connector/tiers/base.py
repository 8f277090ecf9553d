"""The one interface every storage tier implements, and how tier errors are classified.

Payloads are opaque bytes (whole vLLM blocks of every layer of one chunk); tiers never
interpret them. A tier that cannot produce exactly what was stored raises ``ChunkMissing``
or ``ChunkCorrupt``; one that fails as a whole raises an ``OSError`` (``TimeoutError`` when
it did not answer in time). The worker turns each into failed blocks that vLLM recomputes
and a reason that telemetry counts.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from ..engine.outcomes import FailureReason


class ChunkMissing(LookupError):
    """The tier does not hold the chunk (evicted, deleted, never written)."""


class ChunkCorrupt(ValueError):
    """The tier holds something under that name, but not a valid copy of the chunk."""


@runtime_checkable
class Tier(Protocol):
    name: str

    def put(self, name: str, payload: memoryview, namespace: str = "") -> int:
        """Store ``payload`` under ``name``; returns the bytes written. Raises OSError on failure.

        ``namespace``: the key fingerprint of the namespace storing it, kept in the record by
        tiers that write records (for ``kvlens inspect`` and namespace-scoped clears)."""

    def get(self, name: str) -> memoryview:
        """The exact payload stored under ``name``, or ChunkMissing / ChunkCorrupt / OSError."""

    def delete(self, name: str) -> bool | None:
        """Forget ``name``; a missing name is not an error. False: the tier kept it (in use)."""

    def clear(self) -> None:
        """Forget everything this tier stored."""


class TierSkipped(Exception):
    """A queued write was not tried: its tier was skipped while it waited."""


def classify(error: BaseException) -> tuple[FailureReason, str]:
    """The failure reason of a tier error, and a short description for logs and events."""
    if isinstance(error, ChunkMissing):
        reason = FailureReason.MISSING
    elif isinstance(error, TierSkipped):
        reason = FailureReason.TIER_UNHEALTHY
    elif isinstance(error, (ChunkCorrupt, ValueError)):
        reason = FailureReason.CORRUPT
    elif isinstance(error, TimeoutError) or getattr(error, "kind", None) == "timeout":
        reason = FailureReason.TIMEOUT
    else:
        reason = FailureReason.IO_ERROR
    text = str(error)
    return reason, f"{type(error).__name__}: {text}" if text else type(error).__name__
