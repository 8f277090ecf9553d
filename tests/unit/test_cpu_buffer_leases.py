"""A CPU-tier buffer goes back to the payload pool only when no load still reads it.

An asynchronous load reads CPU-tier views on its own thread, layer by layer. If the step
thread drops that chunk meanwhile (a clear past its limit, a chunk forgotten after a stalled
copy) and the next store gathers into the dropped buffer, the load would copy the new chunk's
bytes into the request's blocks: wrong KV, unchecked (the CPU tier has no checksum). The
interleaving is made deterministic by pausing the load's copy between its layers.
"""

from __future__ import annotations

import threading
import time

import torch

from connector.config.loading import load_config
from connector.engine.facts import EngineFacts
from connector.engine.jobs import CPU, ChunkLoad, Eviction, LoadJob, StepPlan, StoreJob
from connector.worker import loads_outside_step
from connector.worker.connector_worker import ConnectorWorker
from connector.worker.kv_blocks import BlockCopier
from connector.worker.payload_pool import PayloadPool

BS, LAYERS, HEADS, HEAD, NUM_BLOCKS = 16, 3, 2, 8, 32


def make_worker() -> tuple[ConnectorWorker, dict[str, torch.Tensor]]:
    storage = torch.randn(LAYERS, NUM_BLOCKS, HEADS, BS, 2 * HEAD)
    kv = {f"model.layers.{i}.self_attn.attn": storage[i] for i in range(LAYERS)}
    block_bytes = BlockCopier(kv, NUM_BLOCKS).block_bytes
    facts = EngineFacts("m", "float32", BS, LAYERS, block_bytes, "layout", 1, "kv_both")
    worker = ConnectorWorker(load_config({"lmcache.chunk_size": 2 * BS}, env={}), facts, rank=0)
    worker.register(kv, NUM_BLOCKS)
    return worker, kv


def run_step(worker: ConnectorWorker, plan: StepPlan) -> None:
    worker.start_load(plan)
    worker.finish_load()
    worker.save(plan)
    worker.take_report()


def blocks(kv: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    return torch.stack([t[ids] for t in kv.values()]).clone()


def test_a_buffer_an_asynchronous_load_reads_is_not_reused_before_it_is_done(monkeypatch):
    worker, kv = make_worker()
    stored = blocks(kv, [0, 1])
    run_step(worker, StepPlan(writes=[StoreJob("a", "x" * 32, (0, 1), (CPU,), 2 * BS)], step=1))

    paused, resume = threading.Event(), threading.Event()
    copy_layer = loads_outside_step.copy_load_layer

    def pausing(copier, load, layer, cancelled):
        if layer == 1:  # layer 0 is in; the rest waits while the step thread goes on
            paused.set()
            assert resume.wait(10)
        return copy_layer(copier, load, layer, cancelled)

    monkeypatch.setattr(loads_outside_step, "copy_load_layer", pausing)
    job = LoadJob("r", (ChunkLoad("x" * 32, CPU, (10, 11), 0, 2 * BS),))
    worker.start_load(StepPlan(async_loads=[job], step=2))
    worker.finish_load()
    worker.save(StepPlan(step=2))
    assert paused.wait(10)

    # the step thread drops the chunk, then a store gathers other KV into a buffer of its shape
    run_step(worker, StepPlan(writes=[Eviction(CPU, "x" * 32)], step=3))
    run_step(worker, StepPlan(writes=[StoreJob("b", "y" * 32, (4, 5), (CPU,), 2 * BS)], step=4))
    resume.set()

    deadline = time.monotonic() + 10
    finished: set[str] = set()
    while "r" not in finished and time.monotonic() < deadline:
        finished, _ = worker.take_finished_loads(idle=True)
    assert finished == {"r"} and not worker.take_failed_blocks()
    assert torch.equal(blocks(kv, [10, 11]), stored), "the load copied bytes gathered after it began"
    worker.shutdown()


def test_a_dropped_buffer_returns_to_the_pool_when_its_last_reader_lets_go():
    pool = PayloadPool(lambda: 1 << 30)
    buffer = torch.zeros(2, 4, dtype=torch.uint8)
    view = memoryview(buffer.numpy()).cast("B")
    pool.own(view, buffer)
    first, second = pool.lease(), pool.lease()
    first.hold(view)
    second.hold(view)
    pool.dropped(view)
    assert pool.take((2, 4)) is None
    first.close()
    assert pool.take((2, 4)) is None
    second.close()
    second.close()  # closing twice lets go once
    assert pool.take((2, 4)) is buffer
