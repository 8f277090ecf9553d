"""Stores reuse the buffers of chunks the CPU tier dropped, and only buffers nothing else reads."""

import threading

import torch

from connector.engine.jobs import CPU, DISK, ChunkLoad, Eviction, LoadJob, StepPlan, StoreJob
from connector.tiers.disk import DiskTier
from connector.worker.payload_pool import PayloadPool

from .test_worker import LAYERS, NAME, cpu_layout, worker

OTHER = "cd" * 16


def cpu_view(w, name):
    return w.tiers[CPU].get(f"{name}.r0")


def address(view: memoryview) -> int:
    return torch.frombuffer(view, dtype=torch.uint8).data_ptr()


def test_a_store_after_an_eviction_gathers_into_the_dropped_buffer_and_stores_the_right_bytes():
    caches = cpu_layout()
    for layerwise in (True, False):
        w = worker(caches, use_layerwise=layerwise)
        w.save(StepPlan(writes=[StoreJob("a", NAME, (2, 5), (CPU,), 32)]))
        first = address(cpu_view(w, NAME))
        w.save(StepPlan(writes=[Eviction(CPU, NAME)]))
        plan = StepPlan(writes=[StoreJob("b", OTHER, (7, 9), (CPU,), 32)])
        for name in caches:
            w.save_layer(plan, name)
        w.save(plan)
        assert address(cpu_view(w, OTHER)) == first
        for t in caches.values():
            t[[12, 13]] = 0
        w.load(StepPlan(loads=[LoadJob("c", (ChunkLoad(OTHER, CPU, (12, 13), 0, 32),))]))
        for t in caches.values():
            assert torch.equal(t[[12, 13]], t[[7, 9]])


def test_a_buffer_shared_with_a_pending_disk_write_is_never_reused(tmp_path, monkeypatch):
    caches = cpu_layout()
    w = worker(caches, tmp_path)
    release = threading.Event()
    put = DiskTier.put

    def slow_put(self, name, payload):
        release.wait(10)
        return put(self, name, payload)

    monkeypatch.setattr(DiskTier, "put", slow_put)
    expected = bytes(cpu_view_after_store(w, NAME, (2, 5), (CPU, DISK)))
    w.save(StepPlan(writes=[Eviction(CPU, NAME)]))  # the disk write of NAME is still queued
    w.save(StepPlan(writes=[StoreJob("b", OTHER, (7, 9), (CPU,), 32)]))
    release.set()
    assert w.flush(10)
    assert bytes(w.tiers[DISK].inner.get(f"{NAME}.r0")) == expected


def cpu_view_after_store(w, name, blocks, tiers):
    w.save(StepPlan(writes=[StoreJob("a", name, blocks, tiers, 32)]))
    return cpu_view(w, name)


def test_the_pool_keeps_at_most_the_room_left_and_only_buffers_it_was_told_it_owns():
    room = [100]
    pool = PayloadPool(lambda: room[0])
    a, b, c = (torch.empty(60, dtype=torch.uint8) for _ in range(3))
    va, vb, vc = (memoryview(t.numpy()) for t in (a, b, c))
    pool.own(va, a)
    pool.own(vb, b)
    pool.dropped(va)
    pool.dropped(vb)  # over the room left: freed, not kept
    pool.dropped(vc)  # never owned (e.g. a payload shared with a disk write)
    assert pool.bytes == 60
    assert pool.take((60,)) is a
    assert pool.take((60,)) is None and pool.bytes == 0


def test_kept_buffers_are_freed_when_the_chunks_need_their_room():
    room = [200]
    pool = PayloadPool(lambda: room[0])
    buffers = [torch.empty(60, dtype=torch.uint8) for _ in range(3)]
    for t in buffers:
        view = memoryview(t.numpy())
        pool.own(view, t)
        pool.dropped(view)
    assert pool.bytes == 180
    room[0] = 70  # the CPU tier took new memory
    pool.trim()
    assert pool.bytes == 60 and pool.take((60,)) is not None and pool.take((60,)) is None


def test_stores_to_the_cpu_tier_alone_take_pool_buffers_of_the_same_shape_only():
    caches = cpu_layout()
    w = worker(caches)
    w.save(StepPlan(writes=[StoreJob("a", NAME, (2, 5, 6), (CPU,), 48)]))
    w.save(StepPlan(writes=[Eviction(CPU, NAME)]))
    assert w.pool.bytes == 3 * LAYERS * w.copier.block_bytes
    w.save(StepPlan(writes=[StoreJob("b", OTHER, (7, 9), (CPU,), 32)]))  # 2 blocks: a new buffer
    assert w.pool.bytes == 3 * LAYERS * w.copier.block_bytes


def test_putting_a_chunk_the_cpu_tier_already_holds_never_hands_its_buffer_to_reuse():
    caches = cpu_layout()
    w = worker(caches)
    w.save(StepPlan(writes=[StoreJob("a", NAME, (2, 5), (CPU,), 32)]))
    held = cpu_view(w, NAME)
    expected = bytes(held)
    w.tiers[CPU].put(f"{NAME}.r0", held)  # e.g. a load that fell back to the CPU tier promotes there
    w.tiers[CPU].put(f"{NAME}.r0", memoryview(held.obj).cast("B"))  # another view of the same bytes
    plan = StepPlan(writes=[StoreJob("b", OTHER, (7, 9), (CPU,), 32)])
    w.save(plan)  # would gather into the held buffer if it had been handed to the pool
    assert address(cpu_view(w, OTHER)) != address(cpu_view(w, NAME))
    assert bytes(cpu_view(w, NAME)) == expected


def test_reusable_buffers_and_chunks_stay_within_the_cpu_budget():
    caches = cpu_layout()
    w = worker(caches)
    chunk = w.copier.payload_nbytes(2)
    budget = 40 * chunk  # chunks may use all of it; dropped buffers only the room they leave
    w = worker(caches, max_local_cpu_size=budget / 1024**3)

    def held() -> int:
        return w.tiers[CPU].used_bytes + w.sizes().reusable_buffer_bytes

    whole = [f"{i:032x}" for i in range(37)]
    for i, name in enumerate(whole):
        w.save(StepPlan(writes=[StoreJob("a", name, (2 * (i % 6), 2 * (i % 6) + 1), (CPU,), 32)]))
    w.save(StepPlan(writes=[Eviction(CPU, name) for name in whole]))  # e.g. a reset
    assert 0 < held() <= budget  # some dropped buffers are kept for reuse, within the budget
    for i in range(75):  # then the tier fills with chunks of another shape (one-block tails)
        w.save(StepPlan(writes=[StoreJob("b", f"{1000 + i:032x}", (i % 12,), (CPU,), 16)]))
        assert held() <= budget, (i, held(), budget)
