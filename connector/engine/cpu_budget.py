"""How the CPU tier's budget (``max_local_cpu_size``) is shared on each rank.

Besides the chunks it holds, the CPU tier keeps buffers of chunks it dropped, so that the next
stores gather into memory already touched instead of page-faulting fresh memory (see
``payload_pool.py``). Both count against the one budget the operator set, as in LMCache's one
allocator of ``max_local_cpu_size``: the chunks may use all of it, and dropped buffers are kept
only in the room the chunks leave (at most ``MAX_REUSABLE_BYTES``), released as soon as the
chunks need it.
"""

from __future__ import annotations

MAX_REUSABLE_BYTES = 256 * 1024**2


def reusable_bytes(budget_bytes: int, chunk_bytes: int) -> int:
    """Bytes of dropped buffers a rank may keep while its CPU tier holds ``chunk_bytes``."""
    return max(0, min(budget_bytes - chunk_bytes, MAX_REUSABLE_BYTES))
