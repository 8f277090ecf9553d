"""One step's block copies, run a layer at a time beside the forward pass.

Loads: every layer's copies are queued when the step starts, in the order the forward pass
reaches the layers; attention of layer N waits only for layer N's copies, so layer N+1 is
copied while layer N computes. Stores: a layer's blocks are gathered as soon as that layer's
KV is complete (``save_kv_layer``), while later layers compute, so the step's end waits only
for the last layer.

The copies run in submission order on a ``CopyRunner``. On CPU that is one daemon thread
off the worker's core(s) (``cpu_affinity``), copying prepared numpy views with ``np.copyto``:
no GIL while bytes move, and little Python between copies to hold the GIL against the
forward pass; the forward pass waits on the host. On CUDA it is a stream of KVLens's own
(``cuda_copies``): the copies are queued there, and the forward pass's stream waits on an
event per layer, so the host never waits on the step path.

Every copy of a step is ordered before the next step (``wait_all``): vLLM may reuse a block
once the step is over, and an eviction or a store must never race a copy. A store's bytes
are read on the host only once its gathers are done (``gathers_ready``): at the step's end
on CPU, when the device has copied them on CUDA.

Every host wait is bounded: a copy thread that died, or copies not finished within
``COPY_TIMEOUT_S``, cancel the step's copies (those not done fail: their blocks are
recomputed, their stores dropped); after a dead or stalled thread the worker copies in the
step from then on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from ..cpu_affinity import run_beside_worker
from .kv_blocks import BlockCopier, CopyPairs

logger = logging.getLogger("vllm.kvlens")

COPY_TIMEOUT_S = 30.0  # far beyond any copy (GBs at memory speed); a stall, not a slow copy


class CopyStalled(RuntimeError):
    """The copy thread died or did not finish a step's copies in time."""


class LayerSource(Protocol):
    """A payload still being read: its layers become usable in order (a disk record)."""

    def wait_layer(self, layer: int) -> None:
        """Return once layer ``layer`` is read and checked; raise why it cannot be used."""
        ...


@dataclass(eq=False)
class BlockLoad:
    """Copy payload blocks ``first_block ..`` into ``block_ids``; ``error`` if a copy (or the
    read of a layer it waits for) raised."""

    payload: torch.Tensor
    block_ids: Sequence[int]
    first_block: int
    pairs: CopyPairs | None = None  # prepared per-layer copies (CPU), else scatter_layer
    source: LayerSource | None = None  # None: every layer of the payload is there already
    promote: Callable[[], None] | None = None  # keep it in faster tiers, once wholly read and copied
    error: BaseException | None = None
    seconds: float = 0.0  # time spent copying, over every layer
    waited: float = 0.0  # time spent waiting for its layers' reads (``source``)


def copy_load_layer(copier: BlockCopier, load: BlockLoad, i: int, stop: Callable[[], bool]) -> float:
    """Copy layer ``i`` of ``load`` into the KV cache, once that layer of its payload is read
    (raises why it cannot be); the seconds spent copying (not waiting)."""
    started = time.perf_counter()
    if load.source is not None:
        load.source.wait_layer(i)
        load.waited += time.perf_counter() - started
        started = time.perf_counter()
    _copy_layer(copier, load, i, stop)
    return time.perf_counter() - started


def _copy_layer(copier: BlockCopier, load: BlockLoad, i: int, stop: Callable[[], bool]) -> None:
    if load.pairs is None:  # a layout numpy cannot copy (strided, K/V-first, not on CPU)
        copier.scatter_layer(i, load.payload, load.block_ids, load.first_block)
        return
    for dst, src in load.pairs[i]:
        if stop():
            return
        np.copyto(dst, src)


@dataclass(eq=False)
class BlockGather:
    """Gather ``block_ids`` of every layer into ``out`` (``[layers, blocks, block_bytes]``)."""

    out: torch.Tensor
    block_ids: Sequence[int]
    pairs: CopyPairs | None = None  # prepared per-layer copies (CPU), else gather_layer
    layers: set[int] = field(default_factory=set)  # layers submitted or done
    error: BaseException | None = None
    seconds: float = 0.0  # time spent gathering, over every layer


class Done(Protocol):
    """Marks the end of submitted copies."""

    def ready(self) -> bool:
        """Whether the copies are finished and their bytes are where they were copied to."""
        ...


class CopyRunner(Protocol):
    """Runs copy tasks in the order they were submitted (a thread, or a device stream)."""

    copies_on_host: bool  # True: a task's copies are done when it returns (False: queued on a device)

    def submit(self, task: Callable[[], None]) -> Done: ...

    def order_forward(self, done: Done, timeout_s: float) -> str | None:
        """Make the forward pass (and everything after it) come after ``done``'s copies; why
        not (the runner gave up), or None."""
        ...

    def wait_host(self, done: Done, timeout_s: float) -> str | None:
        """Return once the host may read what ``done``'s copies wrote; why not, or None."""
        ...

    def close(self, timeout_s: float = 5.0) -> None: ...


class _TaskDone(threading.Event):
    def ready(self) -> bool:
        return self.is_set()


class CopyThread:
    """One daemon thread running copy tasks in the order they were submitted."""

    copies_on_host = True

    def __init__(self, name: str = "kvlens-copies") -> None:
        self._tasks: queue.SimpleQueue[tuple[Callable[[], None], _TaskDone] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, task: Callable[[], None]) -> _TaskDone:
        done = _TaskDone()
        self._tasks.put((task, done))
        return done

    def _run(self) -> None:
        run_beside_worker()  # the point is to copy on another core than the forward pass's
        while True:
            item = self._tasks.get()
            if item is None:
                return
            task, done = item
            try:
                task()
            except BaseException:  # noqa: BLE001 - tasks record their own errors; never die
                logger.exception("KVLens: a block copy task raised")
            finally:
                item = task = None  # type: ignore[assignment]  # idle, hold no step's payloads
                done.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def order_forward(self, done: Done, timeout_s: float) -> str | None:
        return self.wait_host(done, timeout_s)  # the forward pass runs on this host

    def wait_host(self, done: Done, timeout_s: float) -> str | None:
        assert isinstance(done, _TaskDone)
        deadline = time.monotonic() + timeout_s
        while not done.wait(0.05):
            if not self.alive:
                return "the copy thread died"
            if time.monotonic() > deadline:
                return f"the copy thread did not finish in {timeout_s:g} s"
        return None

    def close(self, timeout_s: float = 5.0) -> None:
        self._tasks.put(None)
        self._thread.join(timeout_s)


class StepCopies:
    """The copies of one step. Without a runner (``runner=None``) every copy runs inline."""

    def __init__(
        self, plan: object, copier: BlockCopier, runner: CopyRunner | None, timeout_s: float | None = None
    ) -> None:
        self.plan = plan  # the step these copies belong to
        self._copier = copier
        self._runner = runner
        self._timeout_s = COPY_TIMEOUT_S if timeout_s is None else timeout_s
        self.stalled: CopyStalled | None = None  # set when a wait gave up on the copy thread
        self.loads: list[BlockLoad] = []
        self.gathers: dict[int, BlockGather] | None = None  # by id of the store job; None: none planned
        self._loaded: list[Done | None] = [None] * copier.num_layers
        self._last: Done | None = None

    def start_loads(self, loads: list[BlockLoad]) -> None:
        """Queue every layer's copies of ``loads``, in the order the forward pass needs them."""
        self.loads = loads
        if loads:
            for i in self._copier.order:
                self._loaded[i] = self._submit(lambda i=i: self._load_layer(i))

    def _submit(self, task: Callable[[], None]) -> Done | None:
        if self._runner is None:
            task()
            return None
        self._last = self._runner.submit(task)
        return self._last

    def _load_layer(self, i: int) -> None:
        for load in self.loads:
            if load.error is None and self.stalled is None:
                try:
                    load.seconds += copy_load_layer(self._copier, load, i, lambda: self.stalled is not None)
                except Exception as e:  # noqa: BLE001 - becomes failed blocks, never a crash
                    load.error = e

    def wait_layer(self, name: str) -> None:
        """Layer ``name``'s attention comes after its loads (every layer's, for an unknown name):
        on CPU this returns once they are copied; on CUDA the forward pass's stream waits."""
        i = self._copier.layer_index(name)
        self._order_forward(self._loaded[i] if i is not None else self._last)

    def gather_layer(self, name: str) -> None:
        """Start copying layer ``name``'s blocks of every gather (its KV is complete)."""
        i = self._copier.layer_index(name)
        if i is not None and self.gathers:
            self._submit_gathers(i)

    def _submit_gathers(self, i: int) -> None:
        todo = [g for g in (self.gathers or {}).values() if i not in g.layers]
        for g in todo:
            g.layers.add(i)
        if todo:
            self._submit(lambda: self._gather_layer(i, todo))

    def _gather_layer(self, i: int, gathers: list[BlockGather]) -> None:
        for g in gathers:
            if g.error is None and self.stalled is None:
                started = time.perf_counter()
                try:
                    self._copy_gather(g, i)
                except Exception as e:  # noqa: BLE001 - becomes a failed store
                    g.error = e
                g.seconds += time.perf_counter() - started

    def _copy_gather(self, g: BlockGather, i: int) -> None:
        if g.pairs is None:
            self._copier.gather_layer(i, g.out, g.block_ids)
            return
        for dst, src in g.pairs[i]:
            np.copyto(dst, src)

    def wait_all(self) -> None:
        """Everything after this (the rest of the forward pass, the next step) comes after every
        submitted copy: on CPU this returns once they are done (or the thread was given up on)."""
        self._order_forward(self._last)

    def _order_forward(self, done: Done | None) -> None:
        if done is None or self.stalled is not None:
            return
        assert self._runner is not None
        self._check(self._runner.order_forward(done, self._timeout_s))

    def _check(self, why: str | None) -> None:
        if why is not None:
            self._give_up(why)

    def _give_up(self, why: str) -> None:
        """Cancel what is not done: unfinished loads fail (recomputed), unfinished stores drop."""
        self.stalled = CopyStalled(why)
        for load in self.loads:
            if load.error is None:
                load.error = self.stalled
        for g in (self.gathers or {}).values():
            if g.error is None:
                g.error = self.stalled

    def finish_gathers(self) -> None:
        """Gather the layers no ``save_kv_layer`` call asked for (then every gather is whole, or
        queued to be on a device) and order the next step after every copy."""
        if self._runner is not None and not self._runner.copies_on_host:
            for i in self._copier.order:
                self._submit_gathers(i)
            self.wait_all()
            return
        self.wait_all()  # on the host, what is left is copied inline: no thread hand-off
        for g in (self.gathers or {}).values():
            for i in range(self._copier.num_layers):
                if i not in g.layers:
                    g.layers.add(i)
                    self._gather_layer(i, [g])

    def gathers_ready(self) -> bool:
        """Whether the host may read every gather's bytes (after ``finish_gathers``)."""
        return self._last is None or self.stalled is not None or self._last.ready()

    def wait_gathers(self) -> None:
        """Return once the host may read every gather's bytes, or they failed (bounded wait)."""
        if not self.gathers_ready():
            assert self._runner is not None and self._last is not None
            self._check(self._runner.wait_host(self._last, self._timeout_s))
