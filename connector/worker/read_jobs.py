"""A load job's reads, as the worker holds them from the start of its reads to its report.

A job's chunks are read (and checked) first, then copied into vLLM's blocks; a disk record may
instead be read a layer at a time straight into its blocks (``tiers/disk_layers.py``). Those
reads write into the KV cache on the tier's reader threads: whatever happens to the job (done,
failed, cancelled, or the code reading it raised), they are closed before anything else may
write the blocks or vLLM may reuse them, and a job whose reading raised is failed whole.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..engine.jobs import ChunkLoad, LoadJob
from ..engine.outcomes import ChunkLoadResult, LoadOutcome
from ..tiers.disk_layers import LayeredReads, LayeredRecord
from .async_loads import failed_whole
from .layer_copies import BlockLoad
from .payload_pool import ViewLease

logger = logging.getLogger("vllm.kvlens")

Staged = tuple[ChunkLoadResult, BlockLoad, ChunkLoad]  # a chunk read (or being read), to copy in
Read = memoryview | BaseException | LayeredRecord  # a chunk's read: its payload, why not, or underway
# what a job's reads hold until they are closed: the layer-wise disk reads it started, and the
# lease on the CPU-tier buffers it reads (not reused before the job is done)
Opened = list[LayeredReads | ViewLease]
# a job's chunks read and checked, and what its reads hold
ReadJob = tuple[LoadJob, LoadOutcome, list[Staged], Opened]

NO_PAYLOAD = torch.empty(0, dtype=torch.uint8)  # a load whose reads write into its blocks themselves


def copy_seconds(load: BlockLoad) -> float:
    """How long a load took to land in the KV cache: its copies, or for a load its reads wrote
    into the blocks themselves, the time it waited for them."""
    return load.seconds + load.waited if load.payload is NO_PAYLOAD else load.seconds


def close_reads(jobs: list[ReadJob]) -> None:
    """The jobs are done (or given up): no read of theirs writes into the KV cache after this."""
    for _, _, _, opened in jobs:
        for reads in opened:
            reads.close()


def read_safely(job: LoadJob, read: Callable[[Opened], ReadJob]) -> ReadJob:
    """``read(opened)``, which adds what its reads hold to ``opened``; if it raises, those reads
    are closed (waited for, leases let go) and the job fails whole: vLLM recomputes its blocks."""
    opened: Opened = []
    try:
        return read(opened)
    except Exception as e:  # noqa: BLE001 - a failed load, never a crash inside vLLM
        logger.exception("KVLens: reading the chunks of request %s raised", job.request_id)
        for reads in opened:
            reads.close()
        return job, failed_whole(job, e), [], []


def run_or_defer(effects: list[Callable[[], None]] | None, effect: Callable[[], None]) -> None:
    if effects is None:
        effect()
    else:
        effects.append(effect)
