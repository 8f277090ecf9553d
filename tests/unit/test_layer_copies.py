"""Layer-wise copies (the default): loads and store gathers run on the copy thread beside the
forward pass, a layer at a time, and every step ends with every copy done."""

import threading
import time

import pytest
import torch

from connector.engine.jobs import CPU, ChunkLoad, LoadJob, StepPlan, StoreJob
from connector.engine.outcomes import FailureReason
from connector.worker import layer_copies

from .test_worker import LAYERS, NAME, cpu_layout, worker

SECOND = "cd" * 16
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def stored(w, name=NAME):
    return torch.frombuffer(bytearray(w.tiers[CPU].get(f"{name}.r0")), dtype=torch.uint8)


def store_two_chunks(w):
    w.save(
        StepPlan(writes=[StoreJob("a", NAME, (2, 5), (CPU,), 32), StoreJob("a", SECOND, (6, 7), (CPU,), 32)])
    )


def load_plan(*extra_writes):
    job = LoadJob("b", (ChunkLoad(NAME, CPU, (8, 9), 0, 32), ChunkLoad(SECOND, CPU, (10, 11), 0, 32)))
    return StepPlan(loads=[job], writes=list(extra_writes))


def test_the_default_worker_copies_on_a_thread_and_sync_when_layerwise_is_off():
    assert worker(cpu_layout()).runner is not None
    assert worker(cpu_layout(), use_layerwise=False).runner is None


@pytest.mark.parametrize("layerwise", [True, False])
def test_a_layer_is_loaded_when_its_wait_returns_and_every_layer_after_finish(layerwise):
    caches = cpu_layout()
    w = worker(caches, use_layerwise=layerwise)
    store_two_chunks(w)
    expected = {n: caches[n][[2, 5, 6, 7]].clone() for n in caches}
    for t in caches.values():
        t[8:12] = 0
    plan = load_plan()
    w.start_load(plan)
    for name in LAYER_NAMES:
        w.wait_layer(name)
        assert torch.equal(caches[name][8:12], expected[name])
    (outcome,) = w.finish_load()
    assert outcome.tokens_by_tier() == {CPU: 64} and not outcome.failed
    assert outcome.nbytes == 4 * LAYERS * w.copier.block_bytes
    w.save(plan)
    assert w.take_failed_blocks() == set()


def test_layers_copy_beside_the_forward_pass(monkeypatch):
    """Layer 0's wait returns while later layers are still copying (the overlap itself)."""
    caches = cpu_layout()
    w = worker(caches)
    store_two_chunks(w)
    release = threading.Event()
    copy = layer_copies._copy_layer

    def slow_after_layer_0(copier, load, i, stop):
        if i > 0:
            release.wait(5)
        copy(copier, load, i, stop)

    monkeypatch.setattr(layer_copies, "_copy_layer", slow_after_layer_0)
    plan = load_plan()
    w.start_load(plan)
    started = time.perf_counter()
    w.wait_layer(LAYER_NAMES[0])
    assert time.perf_counter() - started < 2
    assert not torch.equal(caches[LAYER_NAMES[-1]][8], caches[LAYER_NAMES[-1]][2])  # still to come
    release.set()
    w.finish_load()
    w.save(plan)
    assert torch.equal(caches[LAYER_NAMES[-1]][8], caches[LAYER_NAMES[-1]][2])


def test_an_unknown_layer_name_waits_for_every_layer():
    caches = cpu_layout()
    w = worker(caches)
    store_two_chunks(w)
    for t in caches.values():
        t[8:12] = 0
    plan = load_plan()
    w.start_load(plan)
    w.wait_layer("model.layers.99.cross_attn")
    for name in LAYER_NAMES:
        assert torch.equal(caches[name][8], caches[name][2])
    w.finish_load()
    w.save(plan)


def test_a_store_takes_a_layer_when_that_layer_is_saved_and_the_rest_at_the_end():
    caches = cpu_layout()
    w = worker(caches)
    plan = StepPlan(writes=[StoreJob("a", NAME, (2, 5), (CPU,), 32)])
    at_save = {n: caches[n][[2, 5]].clone() for n in caches}
    w.save_layer(plan, LAYER_NAMES[0])
    w.step_copies.wait_all()
    caches[LAYER_NAMES[0]][[2, 5]] = 7  # after its save_kv_layer a layer's KV no longer changes in
    caches[LAYER_NAMES[1]][[2, 5]] = 7  # a step; layers never saved are gathered in save()
    w.save(plan)
    payload = stored(w).view(LAYERS, 2, -1)
    layer0 = at_save[LAYER_NAMES[0]].contiguous().view(torch.uint8).view(2, -1)
    layer1 = caches[LAYER_NAMES[1]][[2, 5]].contiguous().view(torch.uint8).view(2, -1)
    assert torch.equal(payload[0], layer0)
    assert torch.equal(payload[1], layer1)


@pytest.mark.parametrize("layers_saved", [0, 1, LAYERS])
def test_stored_bytes_equal_a_synchronous_store(layers_saved):
    caches = cpu_layout()
    w, sync = worker(caches), worker(caches, use_layerwise=False)
    plan = StepPlan(writes=[StoreJob("a", NAME, (2, 5, 9), (CPU,), 48)])
    for name in LAYER_NAMES[:layers_saved]:
        w.save_layer(plan, name)
        w.save_layer(plan, name)  # a repeated call copies once
    w.save(plan)
    sync.save(StepPlan(writes=[StoreJob("a", NAME, (2, 5, 9), (CPU,), 48)]))
    assert torch.equal(stored(w), stored(sync))


def test_a_copy_that_raises_fails_its_chunk_and_later_ones_and_withdraws_dependent_stores(monkeypatch):
    caches = cpu_layout()
    w = worker(caches)
    store_two_chunks(w)
    copy = layer_copies._copy_layer

    def fail_second_chunk(copier, load, i, stop):
        if tuple(load.block_ids) == (10, 11) and i == 1:
            raise RuntimeError("copy engine fault")
        copy(copier, load, i, stop)

    monkeypatch.setattr(layer_copies, "_copy_layer", fail_second_chunk)
    dependent = StoreJob("b", "ef" * 16, (12, 13), (CPU,), 32, after_loads=(10, 11))
    plan = load_plan(dependent)
    w.start_load(plan)
    for name in LAYER_NAMES:
        w.wait_layer(name)
        w.save_layer(plan, name)
    (outcome,) = w.finish_load()
    failures = w.save(plan)
    assert w.take_failed_blocks() == {10, 11}
    first, second = outcome.chunks
    assert first.ok and not second.ok
    assert second.reason == FailureReason.IO_ERROR and "copy engine fault" in second.detail
    assert outcome.nbytes == 2 * LAYERS * w.copier.block_bytes
    assert [(f.name, f.reason) for f in failures] == [("ef" * 16, FailureReason.DEPENDENCY_FAILED)]
    assert len(w.tiers[CPU]) == 2  # the withdrawn store never reached the tier


def test_a_step_vllm_abandoned_midway_finishes_its_copies_before_the_next(monkeypatch):
    caches = cpu_layout()
    w = worker(caches)
    store_two_chunks(w)
    copy = layer_copies._copy_layer
    copying = []

    def slow(copier, load, i, stop):
        copying.append(i)
        time.sleep(0.05)
        copy(copier, load, i, stop)

    monkeypatch.setattr(layer_copies, "_copy_layer", slow)
    w.start_load(load_plan())  # the forward pass raised: no wait_for_save for this step
    plan = StepPlan(writes=[StoreJob("c", "ef" * 16, (8, 9), (CPU,), 32)])
    w.save(plan)  # the next step's first hook
    assert len(copying) == 2 * LAYERS  # every copy of the abandoned step ran before it
    assert torch.equal(stored(w, "ef" * 16), stored(w, NAME))


def test_shutdown_stops_the_copy_thread():
    w = worker(cpu_layout())
    thread = w.runner._thread
    w.shutdown()
    assert not thread.is_alive()


@pytest.mark.parametrize("make", ["cpu_layout", "kv_first_layout", "strided_layout"])
def test_prepared_copy_pairs_exist_only_for_contiguous_cpu_layers_and_copy_what_scatter_does(make):
    from . import test_worker as tw

    caches = getattr(tw, make)()
    w = worker(caches)
    store_two_chunks(w)
    payload = w.copier.payload_view(w.tiers[CPU].get(f"{NAME}.r0"))
    pairs = w.copier.load_pairs(payload, (8, 9), 0)
    assert (pairs is not None) == (make == "cpu_layout")
    block = (lambda t, b: t[:, b]) if make == "kv_first_layout" else (lambda t, b: t[b])
    for t in caches.values():
        for b in range(8, 12):
            block(t, b).zero_()
    plan = load_plan()
    w.start_load(plan)
    w.finish_load()
    w.save(plan)
    for t in caches.values():
        assert torch.equal(block(t, 8), block(t, 2))
        assert torch.equal(block(t, 11), block(t, 7))


@pytest.mark.parametrize("fault", ["dead", "stalled"])
def test_a_dead_or_stalled_copy_thread_fails_the_loads_instead_of_hanging_the_engine(monkeypatch, fault):
    import connector.worker.layer_copies as layer_copies

    caches = cpu_layout()
    w = worker(caches)
    store_two_chunks(w)
    release = threading.Event()
    if fault == "dead":
        w.runner.close()  # the thread is gone; tasks queue up and never run
    else:
        monkeypatch.setattr(layer_copies, "COPY_TIMEOUT_S", 0.5)
        copy = layer_copies._copy_layer
        monkeypatch.setattr(
            layer_copies, "_copy_layer", lambda c, load, i, stop: (release.wait(5), copy(c, load, i, stop))
        )
    dependent = StoreJob("b", "ef" * 16, (12, 13), (CPU,), 32, after_loads=(8, 9, 10, 11))
    plan = load_plan(dependent)
    started = time.monotonic()
    w.start_load(plan)
    for name in LAYER_NAMES:
        w.wait_layer(name)
        w.save_layer(plan, name)
    (outcome,) = w.finish_load()
    failures = w.save(plan)
    release.set()
    assert time.monotonic() - started < 3
    assert w.take_failed_blocks() == {8, 9, 10, 11}  # recomputed by vLLM
    assert [f.reason for f in failures] == [FailureReason.DEPENDENCY_FAILED]
    assert w.runner is None  # later steps copy in the step
    w.load(load_plan())
    assert w.take_failed_blocks() == set()
    for t in caches.values():
        assert torch.equal(t[[8, 9, 10, 11]], t[[2, 5, 6, 7]])
