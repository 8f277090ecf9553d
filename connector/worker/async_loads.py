"""Loads that run outside vLLM's steps (its asynchronous KV loads).

A request whose chunks sit on a slow tier (disk, Redis) waits in vLLM's
``WAITING_FOR_REMOTE_KVS`` state while the batch goes on; the worker reads, checks and copies
its chunks on a thread of its own, and each step reports the loads that finished (vLLM's
``finished_recving``) with the blocks that failed (recomputed by vLLM before the request runs).

The blocks are the request's alone until the load is reported: vLLM neither caches them nor
frees them before then (an aborted request's blocks wait for its ``finished_recving``), so the
copies never race the forward pass. Everything that touches state the step thread owns (tier
writes of promoted chunks, the step's report) is handed back as ``effects`` and run there.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..cpu_affinity import run_beside_worker
from ..engine.jobs import LoadJob
from ..engine.outcomes import ChunkLoadResult, FailureReason, LoadOutcome

logger = logging.getLogger("vllm.kvlens")


@dataclass(eq=False)
class AsyncLoad:
    job: LoadJob
    outcome: LoadOutcome | None = None
    effects: list[Callable[[], None]] = field(default_factory=list)  # run on the step thread
    cancelled: bool = False
    started: float = field(default_factory=time.perf_counter)


# read_and_copy(job, effects, cancelled) -> the job's outcome, with its blocks copied in
Loader = Callable[[LoadJob, list[Callable[[], None]], Callable[[], bool]], LoadOutcome]


class AsyncLoader:
    def __init__(self, load: Loader, name: str = "kvlens-async-loads") -> None:
        self._load = load
        self._queue: queue.SimpleQueue[AsyncLoad | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._active: dict[str, AsyncLoad] = {}  # submitted, not taken back yet
        self._finished: list[AsyncLoad] = []
        self._done = threading.Event()  # set when a load finishes, cleared when taken
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        return len(self._active)

    def submit(self, job: LoadJob) -> None:
        load = AsyncLoad(job)
        with self._lock:
            self._active[job.request_id] = load
        self._queue.put(load)

    def cancel(self, request_id: str) -> None:
        """The request finished: its load stops at the next chunk (it is still reported)."""
        with self._lock:
            load = self._active.get(request_id)
        if load is not None:
            load.cancelled = True

    def wait_finished(self, timeout_s: float) -> None:
        """Block (without the GIL) until a load finishes or ``timeout_s`` passes: an engine
        whose only work is waiting for loads would otherwise spin empty steps that take the
        interpreter from the loading thread."""
        if self._active:
            self._done.wait(timeout_s)

    def take_finished(self) -> list[AsyncLoad]:
        with self._lock:
            done, self._finished = self._finished, []
            self._done.clear()
            for load in done:
                self._active.pop(load.job.request_id, None)
        return done

    def _run(self) -> None:
        run_beside_worker(background=True)  # the requests it loads for wait outside the batch
        while True:
            load = self._queue.get()
            if load is None:
                return
            try:
                load.outcome = self._load(load.job, load.effects, lambda load=load: load.cancelled)
            except BaseException as e:  # noqa: BLE001 - a load that raised fails whole, never hangs
                logger.exception("KVLens: asynchronous load of %s raised", load.job.request_id)
                load.outcome = failed_whole(load.job, e)
            load.outcome.cancelled = load.cancelled
            with self._lock:
                self._finished.append(load)
                self._done.set()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            for load in self._active.values():
                load.cancelled = True
        self._queue.put(None)
        self._thread.join(timeout_s)


def failed_whole(job: LoadJob, error: BaseException) -> LoadOutcome:
    """Every chunk of the job failed (its blocks are recomputed)."""
    outcome = LoadOutcome(job.request_id)
    for i, chunk in enumerate(job.chunks):
        result = ChunkLoadResult(chunk.name, chunk.tier, chunk.num_tokens)
        result.reason = FailureReason.IO_ERROR if i == 0 else FailureReason.PREFIX_FAILED
        result.detail = f"{type(error).__name__}: {error}"[:200] if i == 0 else ""
        outcome.chunks.append(result)
        outcome.failed_block_ids.extend(chunk.block_ids)
    return outcome
