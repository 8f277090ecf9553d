"""Room in memory before a test starts a vLLM engine.

``scripts/test.sh`` runs three pytest-xdist workers on a two-core, 24 GB machine: each starts
engines of its own (a tiny-model ``vllm serve`` holds about 2.5 GB, a real-model one 3 GB, a
test may hold three). Rather than let three such tests meet and the kernel kill one engine, a
start waits, bounded, until the machine has room for one more engine (``MemAvailable``, which
counts the page cache the kernel can drop). No vLLM, no torch.
"""

from __future__ import annotations

import time

ENGINE_GB = 3.5  # one engine's resident memory with room to spare (measured 2.5-3.1 GB here)
WAIT_S = 300.0  # then it starts anyway: the test fails on its own if memory is short


def available_gb(meminfo: str = "/proc/meminfo") -> float | None:
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        return None
    return None


def wait_for_room(
    need_gb: float = ENGINE_GB,
    wait_s: float = WAIT_S,
    read=available_gb,
    sleep=time.sleep,
    clock=time.monotonic,
) -> float:
    """Waits until ``need_gb`` are available (or ``wait_s`` passed, or the machine cannot say);
    returns the seconds waited."""
    start = clock()
    while True:
        free = read()
        if free is None or free >= need_gb or clock() - start >= wait_s:
            return clock() - start
        sleep(1.0)
