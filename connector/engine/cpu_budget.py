"""How the CPU tier's budget (``max_local_cpu_size``) is shared on each rank.

Besides the chunks it holds, the CPU tier keeps buffers of chunks it dropped, so that the next
stores gather into memory already touched instead of page-faulting fresh memory (see
``payload_pool.py``). Both count against the one budget the operator set: a sixteenth of it,
at most ``MAX_REUSABLE_BYTES``, is kept for those buffers, and the chunks get the rest.
"""

from __future__ import annotations

MAX_REUSABLE_BYTES = 256 * 1024**2


def reusable_bytes(budget_bytes: int) -> int:
    """Bytes of dropped buffers a rank may keep for reuse."""
    return min(budget_bytes // 16, MAX_REUSABLE_BYTES)


def chunk_bytes(budget_bytes: int) -> int:
    """Bytes of chunks the CPU tier may hold on a rank."""
    return budget_bytes - reusable_bytes(budget_bytes)
