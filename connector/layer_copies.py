"""One step's block copies, run a layer at a time beside the forward pass.

Loads: every layer's copies are queued when the step starts, in the order the forward pass
reaches the layers; attention of layer N waits only for layer N's copies, so layer N+1 is
copied while layer N computes. Stores: a layer's blocks are gathered as soon as that layer's
KV is complete (``save_kv_layer``), while later layers compute, so the step's end waits only
for the last layer.

The copies run on one daemon thread, in submission order, off the worker's core(s)
(``cpu_affinity``). On CPU they are prepared numpy views copied with ``np.copyto``: one thread,
no GIL while bytes move, and little Python between copies to hold the GIL against the forward
pass. Every
copy of a step is waited for before the step ends (``wait_all``): vLLM may reuse a block once
the step is over, and an eviction or a store must never race a copy.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .cpu_affinity import run_beside_worker
from .kv_blocks import BlockCopier, CopyPairs

logger = logging.getLogger("vllm.kvlens")


@dataclass(eq=False)
class BlockLoad:
    """Copy payload blocks ``first_block ..`` into ``block_ids``; ``error`` if a copy raised."""

    payload: torch.Tensor
    block_ids: Sequence[int]
    first_block: int
    pairs: CopyPairs | None = None  # prepared per-layer copies (CPU), else scatter_layer
    error: BaseException | None = None
    seconds: float = 0.0  # time spent copying, over every layer


@dataclass(eq=False)
class BlockGather:
    """Gather ``block_ids`` of every layer into ``out`` (``[layers, blocks, block_bytes]``)."""

    out: torch.Tensor
    block_ids: Sequence[int]
    pairs: CopyPairs | None = None  # prepared per-layer copies (CPU), else gather_layer
    layers: set[int] = field(default_factory=set)  # layers submitted or done
    error: BaseException | None = None
    seconds: float = 0.0  # time spent gathering, over every layer


class CopyThread:
    """One daemon thread running copy tasks in the order they were submitted."""

    def __init__(self, name: str = "kvlens-copies") -> None:
        self._tasks: queue.SimpleQueue[tuple[Callable[[], None], threading.Event] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, task: Callable[[], None]) -> threading.Event:
        done = threading.Event()
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
                done.set()

    def close(self, timeout_s: float = 5.0) -> None:
        self._tasks.put(None)
        self._thread.join(timeout_s)


class StepCopies:
    """The copies of one step. Without a thread (``runner=None``) every copy runs inline."""

    def __init__(self, plan: object, copier: BlockCopier, runner: CopyThread | None) -> None:
        self.plan = plan  # the step these copies belong to
        self._copier = copier
        self._runner = runner
        self.loads: list[BlockLoad] = []
        self.gathers: dict[int, BlockGather] | None = None  # by id of the store job; None: none planned
        self._loaded: list[threading.Event | None] = [None] * copier.num_layers
        self._last: threading.Event | None = None

    def start_loads(self, loads: list[BlockLoad]) -> None:
        """Queue every layer's copies of ``loads``, in the order the forward pass needs them."""
        self.loads = loads
        if loads:
            for i in self._copier.order:
                self._loaded[i] = self._submit(lambda i=i: self._load_layer(i))

    def _submit(self, task: Callable[[], None]) -> threading.Event | None:
        if self._runner is None:
            task()
            return None
        self._last = self._runner.submit(task)
        return self._last

    def _load_layer(self, i: int) -> None:
        for load in self.loads:
            if load.error is None:
                started = time.perf_counter()
                try:
                    self._copy_load(load, i)
                except Exception as e:  # noqa: BLE001 - becomes failed blocks, never a crash
                    load.error = e
                load.seconds += time.perf_counter() - started

    def _copy_load(self, load: BlockLoad, i: int) -> None:
        if load.pairs is None:  # a layout numpy cannot copy (strided, K/V-first, not on CPU)
            self._copier.scatter_layer(i, load.payload, load.block_ids, load.first_block)
            return
        for dst, src in load.pairs[i]:
            np.copyto(dst, src)

    def wait_layer(self, name: str) -> None:
        """Return once layer ``name``'s loads are copied (every layer's for an unknown name)."""
        i = self._copier.layer_index(name)
        done = self._loaded[i] if i is not None else self._last
        if done is not None:
            done.wait()

    def gather_layer(self, name: str) -> None:
        """Start copying layer ``name``'s blocks of every gather (its KV is complete)."""
        i = self._copier.layer_index(name)
        if i is None or not self.gathers:
            return
        todo = [g for g in self.gathers.values() if i not in g.layers]
        for g in todo:
            g.layers.add(i)
        if todo:
            self._submit(lambda: self._gather_layer(i, todo))

    def _gather_layer(self, i: int, gathers: list[BlockGather]) -> None:
        for g in gathers:
            if g.error is None:
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
        """Return once every submitted copy is done."""
        if self._last is not None:
            self._last.wait()

    def finish_gathers(self) -> None:
        """Gather inline the layers no ``save_kv_layer`` call asked for (then every gather is whole)."""
        self.wait_all()
        for g in (self.gathers or {}).values():
            for i in range(self._copier.num_layers):
                if i not in g.layers:
                    g.layers.add(i)
                    self._gather_layer(i, [g])
