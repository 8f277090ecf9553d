"""The scheduler and worker halves driven through vLLM's asynchronous-scheduling order.

With async scheduling (vLLM's default on GPU with a connector) the scheduler plans step N+1
before the output of step N, and the worker's report in it, is processed. A chunk computed
in step N+1 over a block whose load failed in step N must still never be stored, and blocks
computed over a failed load must never be the prefix of a stored chunk until rewritten.
The halves are real (a real worker with KV tensors laid out as vLLM's CPU backend lays them
out, a real CPU tier); only vLLM's scheduler is stood in for by the test.
"""

from __future__ import annotations

import pytest
import torch

from connector.config.loading import load_config
from connector.engine.facts import EngineFacts
from connector.engine.jobs import CPU, StepPlan
from connector.engine.keys import storage_name
from connector.scheduler.connector_scheduler import ConnectorScheduler
from connector.worker.connector_worker import ConnectorWorker
from connector.worker.kv_blocks import BlockCopier

from .fakes import request, step

BS, CHUNK, LAYERS, HEADS, HEAD, NUM_BLOCKS = 16, 32, 2, 2, 8, 64


class Engine:
    """One scheduler and one worker; reports reach the scheduler ``delay`` steps late."""

    def __init__(self, delay: int = 1, **extra) -> None:
        storage = torch.randn(LAYERS, NUM_BLOCKS, HEADS, BS, 2 * HEAD)
        self.kv = {f"model.layers.{i}.self_attn.attn": storage[i] for i in range(LAYERS)}
        block_bytes = BlockCopier(self.kv, NUM_BLOCKS).block_bytes
        facts = EngineFacts("m", "float32", BS, LAYERS, block_bytes, "layout", 1, "kv_both")
        config = load_config(
            {"lmcache.chunk_size": CHUNK, **{f"lmcache.{k}": v for k, v in extra.items()}}, env={}
        )
        self.sched = ConnectorScheduler(config, facts)
        self.worker = ConnectorWorker(config, facts, rank=0)
        self.worker.register(self.kv, NUM_BLOCKS)
        self.delay = delay
        self.in_flight: list = []  # reports not yet processed by the scheduler
        self.failed_blocks: list[set[int]] = []  # what vLLM is told, per executed step

    def step(self, output) -> StepPlan:
        """Plan a step, let the worker run it, and deliver the report that is due."""
        plan = self.sched.build_plan(output)
        w = self.worker
        w.start_load(plan)
        w.finish_load()
        w.save(plan)
        self.failed_blocks.append(w.take_failed_blocks())
        self.in_flight.append(w.take_report())
        while len(self.in_flight) > self.delay:
            self.deliver()
        return plan

    def deliver(self) -> None:
        report = self.in_flight.pop(0)
        if report is not None:
            self.sched.on_worker_report(report)

    def stored_names(self) -> set[str]:
        names = self.worker.tiers[CPU]._chunks  # type: ignore[union-attr]
        return {n.removesuffix(storage_name("", 0)) for n in names}


P = list(range(1000, 1064))  # 2 chunks
Q = list(range(2000, 2096))  # 3 more


def stored_prompt(engine: Engine) -> list[str]:
    """Request a computes and stores P; returns its chunk names."""
    a = request("a", P)
    engine.sched.lookup(a, 0)
    engine.sched.after_alloc(a, 0)
    plan = engine.step(step(new=[(a, range(0, 4), 0)], num_scheduled={"a": 64}))
    while engine.in_flight:
        engine.deliver()
    engine.sched.finish(a)
    return [j.name for j in plan.stores]


def failed_load_then_next_step(engine: Engine):
    """b = P + Q finds P stored, but P's second chunk is gone from the tier: the load of step N
    fails; step N+1 is planned before that is reported."""
    names = stored_prompt(engine)
    engine.worker.tiers[CPU].delete(storage_name(names[1], 0))
    b = request("b", P + Q)
    assert engine.sched.lookup(b, 0) == 64
    engine.sched.after_alloc(b, 64)
    blocks_b = list(range(10, 20))
    plan_n = engine.step(step(new=[(b, blocks_b, 64)], num_scheduled={"b": 32}))
    assert plan_n.loads and engine.failed_blocks[-1] == {12, 13}
    plan_n1 = engine.step(step(cached=[("b", None, 96, False)], num_scheduled={"b": 32}))
    return b, blocks_b, plan_n, plan_n1


@pytest.mark.parametrize("delay", [1, 2])
def test_a_chunk_computed_a_step_after_a_failed_load_is_never_stored(delay):
    engine = Engine(delay=delay)
    _, _, plan_n, plan_n1 = failed_load_then_next_step(engine)
    computed_after = [j.name for j in plan_n.stores + plan_n1.stores]
    assert computed_after, "the steps after the load planned stores"
    assert not set(computed_after) & engine.stored_names()
    while engine.in_flight:
        engine.deliver()
    index = set(engine.sched.tiers[CPU].keys())
    assert index == engine.stored_names()  # index and tier agree after every report
    assert not set(computed_after) & index


def test_blocks_computed_over_a_failed_load_stay_suspect_until_rewritten():
    engine = Engine(delay=1)
    b, blocks_b, _, _ = failed_load_then_next_step(engine)
    engine.deliver()  # the failure of step N is known now; vLLM rolled b back to token 32
    # b recomputes [32, 64); c gets a vLLM prefix hit on b's first 128 tokens (8 blocks, six of
    # them computed over the failed load) and computes its own tail.
    c = request("c", P + Q[:64] + list(range(3000, 3064)))
    assert engine.sched.lookup(c, 128) == 0
    engine.sched.after_alloc(c, 0)
    plan = engine.step(
        step(
            new=[(c, blocks_b[:8] + [40, 41, 42, 43], 128)],
            cached=[("b", None, 32, False)],
            num_scheduled={"b": 32, "c": 64},
        )
    )
    tainted = set(blocks_b[4:8])  # computed in steps N and N+1 over blocks 12 and 13
    assert not [j for j in plan.stores if tainted & set(j.block_ids)]
    # c's first two chunks are sound (b rewrites blocks 12 and 13 in this very step); nothing after
    assert all(set(j.block_ids) <= set(blocks_b[:4]) for j in plan.stores if j.request_id == "c")


def test_the_worker_forgets_failures_once_the_scheduler_has_their_report():
    engine = Engine(delay=1)
    failed_load_then_next_step(engine)
    # step N's failure: a store planned before its report may need it
    assert engine.worker.deps._failed_by_step
    for _ in range(3):  # quiet steps: nothing loads, every report has arrived
        engine.step(step())
    assert engine.worker.deps._failed_by_step == {}
    assert engine.sched.state.unreported_loaded_blocks() == set()
