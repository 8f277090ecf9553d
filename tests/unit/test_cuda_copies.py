"""The CUDA copy path's ordering, against a simulated device (tests/unit/fake_cuda.py): each
layer's attention waits for that layer's load, copies wait for the kernels queued before
them, the host reads gathered bytes only after the device copied them and never waits on the
step path, and deferred writes keep step order. That the copies are asynchronous and exact on
a real GPU is scripts/gpu_check.py's to show."""

import time

import torch

from connector.engine.jobs import CPU, ChunkLoad, Eviction, LoadJob, StepPlan, StoreJob
from connector.engine.outcomes import FailureReason
from connector.worker.cuda_copies import CudaCopyStream
from connector.worker.kv_blocks import BlockCopier
from connector.worker.layer_copies import BlockGather, BlockLoad, CopyStalled, StepCopies

from .fake_cuda import FakeGpu
from .test_layer_copies import LAYER_NAMES, stored
from .test_worker import NAME, NUM_BLOCKS, cpu_layout, worker

OTHER = "ef" * 16


def fill(t, ids, value):
    for b in ids:
        t[b].fill_(value)


def blocks(caches, ids):
    return {name: t[list(ids)].clone() for name, t in caches.items()}


def as_payload(copier, per_layer):
    """What a store of these blocks holds: ``[layers, blocks, block_bytes]``."""
    return torch.stack(
        [per_layer[n].contiguous().view(torch.uint8).view(len(per_layer[n]), -1) for n in per_layer]
    )


def step_with(gpu, caches, **kw):
    copier = BlockCopier(caches, NUM_BLOCKS)
    return copier, StepCopies("plan", copier, CudaCopyStream(gpu), **kw)


def test_each_layers_attention_waits_on_the_device_for_that_layers_load_and_the_host_never_waits():
    caches = cpu_layout()
    expected = blocks(caches, (2, 5))
    copier, step = step_with(FakeGpu(prefer="forward"), caches)
    gpu = step._runner._api
    payload = copier.gather([2, 5])
    for t in caches.values():
        t[8:10] = 0
    step.start_loads([BlockLoad(payload, (8, 9), 0)])
    unordered, seen = [], {}
    gpu.launch(lambda: unordered.append(caches[LAYER_NAMES[0]][8:10].clone()))  # no wait_layer first
    for name in LAYER_NAMES:
        step.wait_layer(name)
        gpu.launch(lambda name=name: seen.__setitem__(name, caches[name][8:10].clone()))
    step.wait_all()
    assert all(torch.count_nonzero(t[8:10]) == 0 for t in caches.values())  # only queued so far
    gpu.run()
    assert gpu.queries == 0  # the host never polled, let alone waited
    assert torch.count_nonzero(unordered[0]) == 0  # the device does run ahead of an unawaited load
    for name in LAYER_NAMES:
        assert torch.equal(seen[name], expected[name])


def test_a_load_does_not_overwrite_blocks_that_kernels_queued_before_it_still_read():
    caches = cpu_layout()
    copier, step = step_with(FakeGpu(prefer="copies"), caches)
    gpu = step._runner._api
    payload = copier.gather([2, 5])
    old = blocks(caches, (8, 9))
    read = {}
    for name in LAYER_NAMES:  # the previous step's attention, still queued
        gpu.launch(lambda name=name: read.__setitem__(name, caches[name][8:10].clone()))
    step.start_loads([BlockLoad(payload, (8, 9), 0)])
    gpu.run()
    for name in LAYER_NAMES:
        assert torch.equal(read[name], old[name])
        assert torch.equal(caches[name][8:10], caches[name][[2, 5]])


def test_a_gather_reads_the_kv_its_layer_wrote():
    caches = cpu_layout()
    copier, step = step_with(FakeGpu(prefer="copies"), caches)
    gpu = step._runner._api
    out = copier.new_payload(2)
    step.gathers = {1: BlockGather(out, (2, 5))}
    for i, name in enumerate(LAYER_NAMES[:-1]):
        gpu.launch(lambda name=name, v=i + 1: fill(caches[name], (2, 5), v))  # this layer's KV
        step.gather_layer(name)
    gpu.launch(lambda: fill(caches[LAYER_NAMES[-1]], (2, 5), 9))
    step.finish_gathers()  # the last layer was never saved layer-wise
    assert not step.gathers_ready()  # only queued
    gpu.run()
    assert step.gathers_ready()
    for i, name in enumerate(LAYER_NAMES):
        value = torch.full_like(caches[name][[2, 5]], i + 1 if i < len(LAYER_NAMES) - 1 else 9)
        assert torch.equal(out[i], value.contiguous().view(torch.uint8).view(2, -1))


def test_the_next_step_cannot_overwrite_blocks_before_their_gather():
    caches = cpu_layout()
    copier, step = step_with(FakeGpu(prefer="forward"), caches)
    gpu = step._runner._api
    expected = as_payload(copier, blocks(caches, (2, 5)))
    out = copier.new_payload(2)
    step.gathers = {1: BlockGather(out, (2, 5))}
    step.gather_layer(LAYER_NAMES[0])
    step.finish_gathers()
    gpu.launch(lambda: [fill(t, (2, 5), -1) for t in caches.values()])  # the next step reuses them
    gpu.run()
    assert torch.equal(out, expected)


def test_the_host_waits_for_gathered_bytes_only_when_asked_and_then_with_a_deadline():
    caches = cpu_layout()
    copier, step = step_with(FakeGpu(), caches, timeout_s=0.3)
    gpu = step._runner._api
    step.gathers = {1: BlockGather(copier.new_payload(2), (2, 5))}
    step.finish_gathers()
    assert not step.gathers_ready()
    started = time.monotonic()
    step.wait_gathers()  # the device never runs: the wait gives up
    assert 0.3 <= time.monotonic() - started < 2
    assert isinstance(step.gathers[1].error, CopyStalled)
    _, live = step_with(gpu := FakeGpu(), caches)
    out = copier.new_payload(2)
    live.gathers = {1: BlockGather(out, (2, 5))}
    live.finish_gathers()
    gpu.runs_while_polled = True
    live.wait_gathers()
    assert live.gathers[1].error is None
    assert torch.equal(out, as_payload(copier, blocks(caches, (2, 5))))


# ---- the worker on a device ---------------------------------------------------------------
def device_worker(caches, gpu, **extra):
    w = worker(caches, **extra)
    if w.runner is not None:
        w.runner.close()
    w.runner = CudaCopyStream(gpu)
    return w


def store_step(w, name=NAME, ids=(2, 5), **kw):
    plan = StepPlan(writes=[StoreJob("a", name, ids, (CPU,), 32)], **kw)
    w.start_load(plan)
    for layer in LAYER_NAMES:
        w.wait_layer(layer)
        w.save_layer(plan, layer)
    w.finish_load()
    return plan, w.save(plan)


def test_on_a_device_a_store_reaches_its_tier_once_copied_and_the_engine_keeps_stepping_until_then():
    caches = cpu_layout()
    gpu = FakeGpu(prefer="forward")
    w = device_worker(caches, gpu)
    expected = as_payload(w.copier, blocks(caches, (2, 5)))
    _, failures = store_step(w)
    gpu.launch(lambda: [fill(t, (2, 5), -1) for t in caches.values()])  # the next step reuses them
    assert failures == [] and len(w.tiers[CPU]) == 0
    assert w.take_report().pending_writes == 1  # the scheduler keeps stepping (drain) meanwhile
    gpu.run()
    report = w.take_report()
    assert report.pending_writes == 0 and report.store_failures == []
    assert torch.equal(stored(w).view(expected.shape), expected)


def test_a_drain_step_writes_what_the_device_has_yet_to_copy():
    caches = cpu_layout()
    gpu = FakeGpu()
    w = device_worker(caches, gpu)
    store_step(w)
    gpu.runs_while_polled = True
    w.start_load(drain := StepPlan(drain=True))
    w.finish_load()
    w.save(drain)
    assert len(w.tiers[CPU]) == 1


def test_a_load_of_a_chunk_still_being_copied_out_waits_for_that_store():
    caches = cpu_layout()
    gpu = FakeGpu()
    w = device_worker(caches, gpu)
    store_step(w)
    gpu.runs_while_polled = True  # the device goes on while the host waits
    plan = StepPlan(loads=[LoadJob("b", (ChunkLoad(NAME, CPU, (8, 9), 0, 32),))])
    w.start_load(plan)
    for layer in LAYER_NAMES:
        w.wait_layer(layer)
    (outcome,) = w.finish_load()
    w.save(plan)
    gpu.run()
    assert not outcome.failed and w.take_failed_blocks() == set()
    for t in caches.values():
        assert torch.equal(t[8:10], t[[2, 5]])


def test_an_asynchronous_load_of_a_chunk_still_being_copied_out_waits_for_that_store():
    """With asynchronous scheduling the host runs a step ahead of the device: a load outside
    the step that looks for a chunk whose store the device has yet to copy out finds it."""
    caches = cpu_layout()
    gpu = FakeGpu()
    w = device_worker(caches, gpu)
    store_step(w)
    gpu.runs_while_polled = True  # the device goes on while the host waits
    plan = StepPlan(async_loads=[LoadJob("b", (ChunkLoad(NAME, CPU, (8, 9), 0, 32),))])
    w.start_load(plan)
    w.finish_load()
    w.save(plan)
    done = []
    deadline = time.monotonic() + 10
    while not done and time.monotonic() < deadline:
        done = w.take_finished_loads(idle=True)[1]
    gpu.run()
    ((_, outcome),) = done
    assert not outcome.failed and w.take_failed_blocks() == set()
    for t in caches.values():
        assert torch.equal(t[8:10], t[[2, 5]])


def test_deferred_evictions_and_stores_keep_step_order():
    caches = cpu_layout()
    gpu = FakeGpu()
    w = device_worker(caches, gpu)
    store_step(w)
    evict = StepPlan(writes=[Eviction(CPU, NAME)])
    w.start_load(evict)
    w.finish_load()
    w.save(evict)  # nothing to copy, but it comes after the store still on the device
    gpu.run()
    w.take_report()
    assert len(w.tiers[CPU]) == 0


def test_a_store_over_a_failed_load_is_withdrawn_even_when_written_after_that_failure_is_settled():
    caches = cpu_layout()
    gpu = FakeGpu()
    w = device_worker(caches, gpu)
    missing = ChunkLoad("99" * 16, CPU, (8, 9), 0, 32)
    plan = StepPlan(
        loads=[LoadJob("b", (missing,))],
        writes=[StoreJob("b", OTHER, (8, 9, 10, 11), (CPU,), 64, after_loads=(8, 9))],
        step=1,
    )
    w.start_load(plan)
    w.finish_load()
    w.save(plan)
    assert w.take_failed_blocks() == {8, 9}
    later = StepPlan(step=2, reported_through=1)  # the scheduler has the failure: workers forget it
    w.start_load(later)
    w.finish_load()
    w.save(later)
    gpu.run()
    report = w.take_report()
    assert [(f.name, f.reason) for f in report.store_failures] == [(OTHER, FailureReason.DEPENDENCY_FAILED)]
    assert len(w.tiers[CPU]) == 0


def test_without_layerwise_every_load_is_in_before_the_first_layer_on_a_device():
    caches = cpu_layout()
    gpu = FakeGpu(prefer="forward")
    w = device_worker(caches, gpu, use_layerwise=False)
    store_step(w)
    gpu.run()
    w.take_report()
    for t in caches.values():
        t[8:10] = 0
    plan = StepPlan(loads=[LoadJob("b", (ChunkLoad(NAME, CPU, (8, 9), 0, 32),))])
    w.start_load(plan)
    seen = []
    gpu.launch(lambda: seen.append(caches[LAYER_NAMES[-1]][8:10].clone()))  # layer 0's kernel
    gpu.run()
    assert torch.equal(seen[0], caches[LAYER_NAMES[-1]][[2, 5]])


def test_a_device_that_never_finishes_fails_the_stores_instead_of_hanging(monkeypatch):
    import connector.worker.layer_copies as layer_copies

    monkeypatch.setattr(layer_copies, "COPY_TIMEOUT_S", 0.3)
    caches = cpu_layout()
    w = device_worker(caches, FakeGpu())
    store_step(w)
    plan = StepPlan(loads=[LoadJob("b", (ChunkLoad(NAME, CPU, (8, 9), 0, 32),))])
    started = time.monotonic()
    w.start_load(plan)  # waits for the store, which never comes
    (outcome,) = w.finish_load()
    assert time.monotonic() - started < 3
    assert outcome.failed and w.take_failed_blocks() == {8, 9}  # recomputed
    (failure,) = w.take_report().store_failures
    assert failure.name == NAME and failure.reason == FailureReason.IO_ERROR
    assert "did not finish" in failure.detail
    assert isinstance(w.runner, CudaCopyStream)  # copying in the step would wait on the same device


def test_a_step_run_as_a_full_cuda_graph_has_every_load_in_before_it_starts():
    """vLLM skips wait_for_layer_load inside a full CUDA graph: the graph must wait for all."""
    caches = cpu_layout()
    gpu = FakeGpu(prefer="forward")
    w = device_worker(caches, gpu)
    store_step(w)
    gpu.run()
    w.take_report()
    for t in caches.values():
        t[8:10] = 0
    plan = StepPlan(loads=[LoadJob("b", (ChunkLoad(NAME, CPU, (8, 9), 0, 32),))])
    w.start_load(plan, layer_hooks=False)
    seen = []
    gpu.launch(lambda: seen.append({n: t[8:10].clone() for n, t in caches.items()}))  # the graph
    gpu.run()
    for n, t in caches.items():
        assert torch.equal(seen[0][n], t[[2, 5]])


def test_only_a_full_cuda_graph_step_skips_the_layer_hooks():
    from enum import Enum
    from types import SimpleNamespace

    from connector.vllm_compat import attention_in_full_graph

    Mode = Enum("CUDAGraphMode", "NONE PIECEWISE FULL")  # vLLM's runtime modes, by name
    assert attention_in_full_graph(SimpleNamespace(cudagraph_runtime_mode=Mode.FULL))
    assert not attention_in_full_graph(SimpleNamespace(cudagraph_runtime_mode=Mode.PIECEWISE))
    assert not attention_in_full_graph(SimpleNamespace(cudagraph_runtime_mode=Mode.NONE))
    assert not attention_in_full_graph(SimpleNamespace())  # a vLLM without the attribute
