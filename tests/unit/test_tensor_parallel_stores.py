"""Tensor parallelism: a store computed over a load that failed on another rank is never written.

Under TP every rank's KV depends on every rank's attention output, so when only rank 1's load
of a chunk fails, rank 0's KV computed over it is wrong too. Rank 0 cannot know in its step;
the scheduler learns it from the merged report. One real scheduler and two real workers (each
with its own KV tensors and CPU tier, KVLens's default tier), reports merged as vLLM's
aggregator merges them, delivered at once (synchronous scheduling) or a step late
(asynchronous scheduling); the fault is on rank 1 only.
"""

from __future__ import annotations

import pytest
import torch

from connector.config.loading import load_config
from connector.engine.facts import EngineFacts
from connector.engine.jobs import CPU, Eviction, StepPlan
from connector.engine.keys import storage_name
from connector.scheduler.connector_scheduler import ConnectorScheduler
from connector.worker.connector_worker import ConnectorWorker
from connector.worker.kv_blocks import BlockCopier

from .fakes import request, step

BS, CHUNK, LAYERS, HEADS, HEAD, NUM_BLOCKS, TP = 16, 32, 2, 2, 8, 64, 2


class TensorParallelEngine:
    """One scheduler, two workers; every put into a tier is recorded, per rank."""

    def __init__(self, delay: int) -> None:
        self.kv = []
        self.workers = []
        config = load_config({"lmcache.chunk_size": CHUNK}, env={})
        for rank in range(TP):
            storage = torch.randn(LAYERS, NUM_BLOCKS, HEADS, BS, 2 * HEAD)
            kv = {f"model.layers.{i}.self_attn.attn": storage[i] for i in range(LAYERS)}
            block_bytes = BlockCopier(kv, NUM_BLOCKS).block_bytes
            facts = EngineFacts("m", "float32", BS, LAYERS, block_bytes, "layout", TP, "kv_both")
            worker = ConnectorWorker(config, facts, rank=rank)
            worker.register(kv, NUM_BLOCKS)
            self.kv.append(kv)
            self.workers.append(worker)
        self.sched = ConnectorScheduler(config, facts)
        self.delay = delay
        self.in_flight: list = []
        self.put: list[set[str]] = [set() for _ in range(TP)]  # every chunk each rank ever wrote
        for rank, worker in enumerate(self.workers):
            tier = worker.tiers[CPU]
            original = tier.put

            def recording(name, payload, *args, rank=rank, original=original):
                self.put[rank].add(name.removesuffix(storage_name("", rank)))
                return original(name, payload, *args)

            tier.put = recording  # type: ignore[method-assign]
        self.stored_counted = 0  # chunks the merged reports counted as stored in the CPU tier

    def step(self, output) -> StepPlan:
        plan = self.sched.build_plan(output)
        merged = None
        for worker in self.workers:
            worker.start_load(plan)
            worker.finish_load()
            worker.save(plan)
            worker.take_failed_blocks()
            report = worker.take_report()
            if report is not None:
                merged = report if merged is None else merged.merge(report)
        self.in_flight.append(merged)
        while len(self.in_flight) > self.delay:
            self.deliver()
        return plan

    def deliver(self) -> None:
        report = self.in_flight.pop(0)
        if report is not None:
            traffic = report.traffic.get(CPU)
            self.stored_counted += traffic.stored_chunks if traffic is not None else 0
            self.sched.on_worker_report(report)

    def settle(self) -> None:
        for _ in range(3):  # quiet steps: every report arrives, every held store is settled
            self.step(step())
        while self.in_flight:
            self.deliver()

    def held(self, rank: int) -> set[str]:
        names = self.workers[rank].tiers[CPU]._chunks  # type: ignore[union-attr]
        return {n.removesuffix(storage_name("", rank)) for n in names}


P = list(range(1000, 1064))  # 2 chunks
Q = list(range(2000, 2064))  # 2 more


def store_p(engine: TensorParallelEngine) -> list[str]:
    a = request("a", P)
    engine.sched.lookup(a, 0)
    engine.sched.after_alloc(a, 0)
    plan = engine.step(step(new=[(a, range(0, 4), 0)], num_scheduled={"a": 64}))
    engine.sched.finish(a)
    engine.settle()
    return [j.name for j in plan.stores]


def load_p_compute_q(engine: TensorParallelEngine) -> StepPlan:
    """b = P + Q finds P stored and loads it; in the same step it computes Q over it."""
    b = request("b", P + Q)
    assert engine.sched.lookup(b, 0) == 64
    engine.sched.after_alloc(b, 64)
    return engine.step(step(new=[(b, list(range(10, 18)), 64)], num_scheduled={"b": 64}))


@pytest.mark.parametrize("delay", [0, 1])
def test_a_load_failing_on_one_rank_withdraws_the_stores_over_it_on_every_rank(delay):
    engine = TensorParallelEngine(delay)
    p = store_p(engine)
    assert engine.held(0) == engine.held(1) == set(p)
    engine.workers[1].tiers[CPU].delete(storage_name(p[1], 1))  # rank 1 only: P's second chunk
    plan = load_p_compute_q(engine)
    over_failed = [j.name for j in plan.stores]
    assert over_failed and all(j.after_loads for j in plan.stores)
    counted_before = engine.stored_counted
    engine.settle()
    for rank in range(TP):
        assert not set(over_failed) & engine.put[rank], f"rank {rank} wrote KV computed over a failed load"
    assert engine.stored_counted == counted_before  # nothing counted as stored
    index = set(engine.sched.tiers[CPU].keys())
    assert not set(over_failed) & index
    assert engine.held(0) == engine.held(1) == index  # every rank's tier holds what the index says


@pytest.mark.parametrize("delay", [0, 1])
def test_stores_over_loads_every_rank_made_are_written_once_reported(delay):
    engine = TensorParallelEngine(delay)
    p = store_p(engine)
    plan = load_p_compute_q(engine)
    q = [j.name for j in plan.stores]
    assert q and all(j.settled_by == plan.step for j in plan.stores)
    for rank in range(TP):
        assert not set(q) & engine.held(rank)  # held until the step's merged report
    if delay:  # asynchronous scheduling: the next lookup comes before the report
        c = request("c", P + Q)
        assert engine.sched.lookup(c, 0) == 64  # a held chunk is not found
        engine.sched.finish(c)
    engine.settle()
    index = set(engine.sched.tiers[CPU].keys())
    assert set(p + q) <= index
    assert engine.held(0) == engine.held(1) == index
    assert engine.stored_counted == 4
    assert all(len(w.deps) == 0 for w in engine.workers)


def test_an_eviction_after_a_held_store_drops_it():
    engine = TensorParallelEngine(delay=1)
    store_p(engine)
    plan = load_p_compute_q(engine)
    name = plan.stores[0].name
    for worker in engine.workers:
        worker.writes.evict(Eviction(CPU, name))
    engine.settle()
    assert all(name not in engine.held(rank) for rank in range(TP))
