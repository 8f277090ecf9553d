"""Asynchronous loads: a request whose chunks sit on a slow tier waits outside the batch while
the worker reads and copies them, as vLLM's connector API lets a load do (``load_kv_async``,
``WAITING_FOR_REMOTE_KVS``, ``finished_recving``). Both halves are real; vLLM's scheduler is
stood in for by the test, in its order of calls."""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from connector.config.loading import load_config
from connector.engine.facts import EngineFacts
from connector.engine.jobs import CPU, DISK
from connector.engine.outcomes import FailureReason
from connector.scheduler.connector_scheduler import ConnectorScheduler
from connector.tiers.disk import chunk_files
from connector.worker.connector_worker import ConnectorWorker
from connector.worker.kv_blocks import BlockCopier

from .fakes import request, step

BS, CHUNK, LAYERS, HEADS, HEAD, NUM_BLOCKS = 16, 32, 2, 2, 8, 64
PROMPT = list(range(1000, 1072))  # two whole chunks and half a block


class Engine:
    def __init__(self, disk, recompute_policy: bool = False, **extra) -> None:
        storage = torch.randn(LAYERS, NUM_BLOCKS, HEADS, BS, 2 * HEAD)
        self.kv = {f"model.layers.{i}.self_attn.attn": storage[i] for i in range(LAYERS)}
        block_bytes = BlockCopier(self.kv, NUM_BLOCKS).block_bytes
        facts = EngineFacts(
            "m",
            "float32",
            BS,
            LAYERS,
            block_bytes,
            "layout",
            1,
            "kv_both",
            failed_blocks_stay_cached=recompute_policy,
        )
        settings = {
            "lmcache.chunk_size": CHUNK,
            "lmcache.local_cpu": False,
            "lmcache.local_disk": str(disk),
            "lmcache.max_local_disk_size": 0.1,
            "lmcache.enable_async_loading": True,
            **{f"lmcache.{k}": v for k, v in extra.items()},
        }
        config = load_config(settings, env={})
        self.sched = ConnectorScheduler(config, facts)
        self.worker = ConnectorWorker(config, facts, rank=0)
        self.worker.register(self.kv, NUM_BLOCKS)
        self.invalid: set[int] = set()

    def step(self, output=None):
        """One engine step: plan, run, and vLLM's update from the worker's output."""
        plan = self.sched.build_plan(output or step())
        w = self.worker
        w.start_load(plan)
        w.finish_load()
        w.save(plan)
        received, _ = w.take_finished_loads()
        self.invalid |= w.take_failed_blocks()
        report = w.take_report()
        if report is not None:
            self.sched.on_worker_report(report)
        return plan, received

    def until_received(self, rid: str, timeout_s: float = 10.0) -> int:
        deadline = time.monotonic() + timeout_s
        steps = 0
        while time.monotonic() < deadline:
            steps += 1
            _, received = self.step()
            if rid in received:
                return steps
            time.sleep(0.01)
        raise AssertionError(f"{rid} never finished loading")

    def blocks(self, ids):
        return torch.stack([t[list(ids)] for t in self.kv.values()])


def stored(engine: Engine) -> torch.Tensor:
    """Request a computes and stores PROMPT's chunks in blocks 0-3; their KV."""
    a = request("a", PROMPT)
    assert engine.sched.lookup(a, 0) == 0
    engine.sched.after_alloc(a, 0)
    engine.step(step(new=[(a, range(0, 5), 0)], num_scheduled={"a": 72}))
    assert engine.worker.flush(10)
    engine.sched.finish(a)
    engine.step()  # the writes' report
    return engine.blocks(range(0, 4)).clone()


def test_a_disk_hit_loads_outside_the_batch_and_the_request_resumes_with_it(tmp_path):
    e = Engine(tmp_path)
    kv = stored(e)
    b = request("b", PROMPT)
    assert e.sched.lookup(b, 0) == 64 and e.sched.loads_async("b")
    assert e.sched.after_alloc(b, 64, list(range(20, 26))).external_tokens == 64
    plan, _ = e.step()
    assert [j.request_id for j in plan.async_loads] == ["b"] and not plan.loads
    e.until_received("b")
    assert torch.equal(e.blocks(range(20, 24)), kv) and not e.invalid
    assert e.sched.tiers[DISK].pinned_keys == 0  # pins held only until the load was reported
    # vLLM schedules it now, as a new request with the loaded tokens computed
    assert e.sched.after_alloc(b, 0) is None  # counted once, at the first allocation
    plan, _ = e.step(step(new=[(b, range(20, 26), 64)], num_scheduled={"b": 8}))
    assert not plan.loads and not plan.async_loads
    assert not [j for j in plan.stores if j.num_tokens == CHUNK]  # its whole chunks are stored already
    usage = e.sched.finish(b).params["kvlens"]
    assert usage["loaded_tokens"] == {DISK: 64} and usage["failed_blocks"] == 0


def test_a_failed_asynchronous_load_reports_its_blocks_with_the_finish_and_heals(tmp_path):
    e = Engine(tmp_path)
    stored(e)
    for path in chunk_files(str(tmp_path)):
        with open(path, "r+b") as f:  # every chunk turns corrupt
            f.seek(-4, os.SEEK_END)
            f.write(b"\xff\xff\xff\xff")
    b = request("b", PROMPT)
    e.sched.lookup(b, 0)
    e.sched.after_alloc(b, 64, list(range(20, 26)))
    e.until_received("b")
    assert e.invalid == {20, 21, 22, 23}  # with finished_recving: vLLM recomputes them
    assert len(e.sched.tiers[DISK]) == 0  # the damaged chunks left the index
    # vLLM reschedules b with nothing computed; it recomputes and stores good copies
    plan, _ = e.step(step(new=[(b, range(20, 26), 0)], num_scheduled={"b": 72}))
    assert [j.num_tokens for j in plan.stores][:2] == [CHUNK, CHUNK]
    assert e.sched.finish(b).params["kvlens"]["failed_blocks"] == 4


def test_an_aborted_request_keeps_its_pins_until_its_load_is_reported_then_frees_everything(tmp_path):
    e = Engine(tmp_path)
    stored(e)
    b = request("b", PROMPT)
    e.sched.lookup(b, 0)
    e.sched.after_alloc(b, 64, list(range(20, 26)))
    e.sched.finish(b)  # aborted while waiting for its KV
    assert e.sched.tiers[DISK].pinned_keys == 2  # the worker may still be reading them
    plan, received = e.step()
    assert plan.cancel_async == [] or "b" in plan.cancel_async
    if "b" not in received:
        e.until_received("b")  # reported, so that vLLM frees its blocks
    assert e.sched.tiers[DISK].pinned_keys == 0 and not e.invalid
    assert e.sched.sizes().pinned_requests == 0 and not e.sched.state.async_loading


def test_an_asynchronous_load_is_settled_once_every_rank_has_reported(tmp_path):
    from connector.engine.outcomes import ChunkLoadResult, LoadOutcome, WorkerReport

    e = Engine(tmp_path)
    stored(e)
    e.sched.state.facts = dataclasses.replace(e.sched.state.facts, world_size=2)  # two ranks report
    b = request("b", PROMPT)
    e.sched.lookup(b, 0)
    e.sched.after_alloc(b, 64, list(range(20, 26)))
    job = e.sched.build_plan(step()).async_loads[0]

    def rank_outcome() -> LoadOutcome:
        out = LoadOutcome("b")
        for c in job.chunks:
            out.chunks.append(ChunkLoadResult(c.name, c.tier, c.num_tokens, tier=c.tier))
        return out

    e.sched.on_worker_report(WorkerReport(loads={"b": rank_outcome()}))
    assert "b" in e.sched.state.async_loading and "b" not in e.sched.state.async_outcomes
    e.sched.on_worker_report(WorkerReport(loads={"b": rank_outcome()}))
    assert "b" not in e.sched.state.async_loading
    _, settled = e.sched.state.async_outcomes["b"]
    assert settled.tokens_by_tier() == {DISK: 64}  # loaded on both ranks


def test_cpu_tier_hits_and_the_setting_off_stay_in_the_step(tmp_path):
    e = Engine(tmp_path, enable_async_loading=False)
    stored(e)
    b = request("b", PROMPT)
    assert e.sched.lookup(b, 0) == 64 and not e.sched.loads_async("b")
    e2 = Engine(tmp_path / "x", local_cpu=True, max_local_cpu_size=0.1)
    stored(e2)
    c = request("c", PROMPT)
    assert e2.sched.lookup(c, 0) == 64 and not e2.sched.loads_async("c")  # found in the CPU tier


def test_a_lone_request_loads_a_fast_tier_in_the_step_and_one_beside_others_outside_it(tmp_path):
    """Nobody waits for a load in an otherwise empty engine: a disk hit measured to be short
    loads in the step (no step round trip); beside a running request it waits outside."""

    def looked_up(engine: Engine, rid: str, **speeds) -> bool:
        for _ in range(2):  # two loads measured: 1 MB in 1 ms
            engine.sched.state.tier_speeds.observe(DISK, 1e6, speeds.get("seconds", 1e-3))
        assert engine.sched.lookup(request(rid, PROMPT), 0) == 64
        return engine.sched.loads_async(rid)

    e = Engine(tmp_path)
    stored(e)
    assert e.sched.lookup(request("unmeasured", PROMPT), 0) == 64 and e.sched.loads_async("unmeasured")
    assert not looked_up(e, "alone")
    b = request("b", PROMPT)
    assert not looked_up(e, "b")
    kv = e.blocks(range(0, 4)).clone()
    e.sched.after_alloc(b, 64, list(range(20, 26)))
    plan, _ = e.step(step(new=[(b, range(20, 26), 64)], num_scheduled={"b": 8}))
    assert [j.request_id for j in plan.loads] == ["b"] and not plan.async_loads
    assert torch.equal(e.blocks(range(20, 24)), kv) and not e.invalid
    assert looked_up(e, "beside")  # b is in the engine now
    off = Engine(tmp_path / "off", extra_config={"async_load_in_step_max_ms": 0})
    stored(off)
    assert looked_up(off, "off")
    slow = Engine(tmp_path / "slow")
    stored(slow)
    assert looked_up(slow, "slow", seconds=100.0)  # 100 s a MB: too long a step for arrivals


def test_where_vllm_keeps_failed_blocks_cached_a_disk_load_is_never_made_in_the_step(tmp_path):
    """Under vLLM's ``recompute`` policy a failed load's blocks stay in its prefix cache until
    their owner recomputes them. A load in the step has them cached from the start, so another
    request (this step's, the one vLLM already planned, a later arrival) computes over the
    unfilled blocks when it fails. Every disk load is made outside the step there, even alone
    on a disk measured fast, and even with ``enable_async_loading`` off; CPU hits stay in it."""
    e = Engine(tmp_path, recompute_policy=True)
    stored(e)
    for _ in range(2):  # measured: 1 MB in 1 ms, well within async_load_in_step_max_ms
        e.sched.state.tier_speeds.observe(DISK, 1e6, 1e-3)
    assert e.sched.lookup(request("alone", PROMPT), 0) == 64 and e.sched.loads_async("alone")
    off = Engine(tmp_path / "off", recompute_policy=True, enable_async_loading=False)
    stored(off)
    assert off.sched.lookup(request("off", PROMPT), 0) == 64 and off.sched.loads_async("off")
    cpu = Engine(tmp_path / "cpu", recompute_policy=True, local_cpu=True, max_local_cpu_size=0.1)
    stored(cpu)
    assert cpu.sched.lookup(request("c", PROMPT), 0) == 64 and not cpu.sched.loads_async("c")


def test_an_asynchronous_load_reports_the_bytes_it_read_and_copied(tmp_path):
    e = Engine(tmp_path)
    stored(e)
    b = request("b", PROMPT)
    e.sched.lookup(b, 0)
    e.sched.after_alloc(b, 64, list(range(20, 26)))
    reports = []
    w, sched = e.worker, e.sched
    sched_report = sched.on_worker_report
    sched.on_worker_report = lambda report: (reports.append(report), sched_report(report))
    e.until_received("b")
    e.step()  # the step after: its report carries what the load's thread moved
    moved = {}
    for report in reports:
        for stage, m in report.tier_traffic(DISK).moved.items():
            moved[stage.value] = moved.get(stage.value, 0) + m.nbytes
    payload = 2 * LAYERS * (CHUNK // BS) * w.copier.block_bytes  # two chunks
    assert moved.get("read") == payload and moved.get("copy") == payload, moved


def test_a_chunk_an_asynchronous_load_promotes_is_not_evicted_before_it_lands(tmp_path):
    from .fakes import cpu_gb

    chunk_bytes = LAYERS * (CHUNK // BS) * BlockCopier(Engine(tmp_path / "probe").kv, NUM_BLOCKS).block_bytes
    e = Engine(tmp_path, local_cpu=True, max_local_cpu_size=cpu_gb(2 * chunk_bytes))
    stored(e)  # PROMPT's two chunks, in the CPU tier and on disk
    other, third = list(range(3000, 3064)), list(range(5000, 5064))
    for rid, prompt, first in (("o", other, 30), ("t", third, 40)):
        r = request(rid, prompt)
        e.sched.lookup(r, 0)
        e.sched.after_alloc(r, 0)
        plan = step(new=[(r, range(first, first + 4), 0)], num_scheduled={rid: 64})
        if rid == "o":  # other's chunks push PROMPT's out of the CPU tier: b's hit is on disk
            e.step(plan)
            e.sched.finish(r)
            b = request("b", PROMPT)
            assert e.sched.lookup(b, 0) == 64 and e.sched.loads_async("b")
            e.sched.after_alloc(b, 64, list(range(20, 26)))  # promotes PROMPT's chunks to CPU
        else:  # in the step that starts b's load, another request stores two chunks
            _, received = e.step(plan)
    if "b" not in received:
        e.until_received("b")
    for _ in range(3):
        e.step()
    held = {name.removesuffix(".r0") for name in e.worker.tiers[CPU]._chunks}
    assert held == set(e.sched.tiers[CPU].keys())  # the tier holds exactly what the index says
    assert e.worker.tiers[CPU].used_bytes <= 2 * chunk_bytes


def stored_on_disk_only(tmp_path) -> Engine:
    """An engine with a CPU tier whose PROMPT's chunks are on disk only (a hit is promoted)."""
    e = Engine(tmp_path, local_cpu=True)
    stored(e)
    for name in e.sched.tiers[CPU].keys():
        e.sched.state.forget(CPU, name, FailureReason.MISSING)
    e.step()
    return e


def test_an_aborted_load_leaves_the_cpu_tier_and_its_index_agreeing(tmp_path):
    e = stored_on_disk_only(tmp_path)
    b = request("b", PROMPT)
    assert e.sched.lookup(b, 0) == 64 and e.sched.loads_async("b")
    e.sched.after_alloc(b, 64, list(range(20, 26)))  # its chunks are promoted into the CPU tier
    assert len(e.sched.tiers[CPU]) == 2 and e.sched.tiers[CPU].pinned_keys == 2
    e.sched.finish(b)  # aborted before its load started: nothing is read, nothing promoted
    _, received = e.step()
    if "b" not in received:
        e.until_received("b")
    e.step()
    held = {name.removesuffix(".r0") for name in e.worker.tiers[CPU]._chunks}
    assert held == set(e.sched.tiers[CPU].keys())
    assert e.sched.tiers[CPU].pinned_keys == 0 and not e.sched.state.async_promotions


def test_a_chunk_still_being_promoted_is_not_looked_up_in_the_cpu_tier(tmp_path):
    e = stored_on_disk_only(tmp_path)
    b = request("b", PROMPT)
    assert e.sched.lookup(b, 0) == 64
    e.sched.after_alloc(b, 64, list(range(20, 26)))  # promotes them into the CPU tier, steps from now
    c = request("c", PROMPT)  # the same prompt meanwhile: the CPU tier does not hold it yet
    assert e.sched.lookup(c, 0) == 64 and e.sched.loads_async("c")
    e.sched.after_alloc(c, 64, list(range(30, 36)))
    received: set[str] = set()
    for _ in range(500):
        received |= e.step()[1]
        if received >= {"b", "c"}:
            break
        time.sleep(0.01)
    assert received >= {"b", "c"} and not e.invalid  # both loaded from disk; nothing failed
    d = request("d", PROMPT)  # once b's load is reported, the promoted copies serve
    assert e.sched.lookup(d, 0) == 64 and not e.sched.loads_async("d")
