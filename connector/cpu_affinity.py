"""Where KVLens's own threads in a vLLM worker may run.

vLLM's CPU worker binds its threads to the worker's cores (``VLLM_CPU_OMP_THREADS_BIND``)
before it creates the connector, and a thread inherits the binding of the thread that
started it: without care, KVLens's copy, write and read threads would all share the worker's
core(s) with the forward pass they are meant to run beside. Each of them calls
``run_beside_worker()`` first, which widens its own binding (only its own: ``sched_setaffinity``
with pid 0 applies to the calling thread) to every CPU of the NUMA nodes that hold the
worker's cores, so copies stay next to the memory they copy. The kernel keeps the thread
inside the process's cpuset (a container's CPU limit still holds).

A slow tier's reader threads and the thread of loads outside the step also lower their own
scheduling priority (``background=True``): where cores are scarce (vLLM's CPU backend), the
forward pass gets the CPU first and they use what it leaves, instead of slowing every running
request's step. While the forward pass waits for one of their reads, its core is idle and
theirs. The copy thread keeps its priority (the forward pass waits for its layer-wise copies),
and so do the writers (the next request looks up what they write).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable

logger = logging.getLogger("vllm.kvlens")

_NODES = "/sys/devices/system/node"


def parse_cpulist(text: str) -> set[int]:
    """``"0-3,8,10-11"`` (the kernel's list format) as a set; raises ValueError if malformed."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        lo, hi = int(first), int(last or first)
        if lo < 0 or hi < lo:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.update(range(lo, hi + 1))
    return cpus


def node_cpus(bound: Iterable[int], nodes_dir: str = _NODES) -> set[int]:
    """Every CPU of the NUMA nodes holding any CPU in ``bound``; all CPUs where nodes are unknown."""
    bound = set(bound)
    wider: set[int] = set()
    try:
        for entry in os.listdir(nodes_dir):
            if entry.startswith("node") and entry[4:].isdigit():
                with open(os.path.join(nodes_dir, entry, "cpulist")) as f:
                    cpus = parse_cpulist(f.read())
                if cpus & bound:
                    wider |= cpus
    except (OSError, ValueError):
        wider = set()
    return (wider or set(range(os.cpu_count() or 1))) | bound


BACKGROUND_NICE = 10  # added to a background thread's nice value (lower priority)


def run_beside_worker(background: bool = False) -> None:
    """Let the calling thread run on any CPU of the worker's NUMA node(s), not only its cores;
    ``background``: at a lower priority than the forward pass."""
    try:
        os.sched_setaffinity(0, node_cpus(os.sched_getaffinity(0)))
    except (AttributeError, OSError, ValueError) as e:  # not Linux, or not allowed: stay bound
        logger.debug("KVLens: thread keeps its CPU binding: %s", e)
    if background:
        lower_own_priority()


def lower_own_priority(step: int = BACKGROUND_NICE) -> None:
    """Raise the calling thread's nice value by ``step`` (Linux: nice is per thread)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(os.getpriority(os.PRIO_PROCESS, tid) + step, 19))
    except (AttributeError, OSError) as e:  # not Linux: the thread keeps its priority
        logger.debug("KVLens: thread keeps its priority: %s", e)
