"""The remote tier inside KVLens's scheduler and worker halves, against a real redis-server:
two "engines" share KV through it, lookups cost one bounded round trip, and a Redis that
stops or loses chunks costs misses and recomputes, never wrong KV or a stuck engine."""

from __future__ import annotations

import dataclasses
import re
import threading
import time

import torch

from connector.config.loading import load_config
from connector.engine.facts import EngineFacts
from connector.engine.jobs import CPU, REMOTE
from connector.engine.keys import storage_name
from connector.engine.outcomes import MissReason, TierState, WorkerReport
from connector.scheduler.connector_scheduler import ConnectorScheduler
from connector.tiers import codec
from connector.worker.connector_worker import ConnectorWorker
from connector.worker.kv_blocks import BlockCopier

from ..unit.fakes import request, step

NUM_BLOCKS, LAYERS, HEADS, BS, HEAD = 32, 2, 2, 16, 8
PROMPT = list(range(1000, 1000 + 5 * BS))  # two 32-token chunks and a one-block tail
FULL_HIT = 5 * BS - 1  # vLLM computes the last token itself


def caches() -> dict[str, torch.Tensor]:
    storage = torch.randn(LAYERS, NUM_BLOCKS, HEADS, BS, 2 * HEAD)
    return {f"layer.{i}": storage[i] for i in range(LAYERS)}


@dataclasses.dataclass
class Steps:
    """What the steps that served one request did: its loads (in the step or outside it) and stores."""

    loads: list
    stores: list


class Engine:
    """A scheduler half and a worker half over their own KV tensors, stepping like vLLM."""

    def __init__(self, url: str, **extra) -> None:
        self.kv = caches()
        copier = BlockCopier(self.kv, NUM_BLOCKS)
        facts = EngineFacts("m", "f32", BS, LAYERS, copier.block_bytes, "layout", 1, "kv_both")
        cfg = {
            "lmcache.chunk_size": 2 * BS,
            "lmcache.max_local_cpu_size": 0.01,
            "lmcache.remote_url": url,
            "lmcache.extra_config": {"remote_lookup_timeout_ms": 200, "remote_timeout_s": 0.5, **extra},
        }
        config = load_config(cfg, env={})
        self.sched = ConnectorScheduler(config, facts)
        self.worker = ConnectorWorker(config, facts, rank=0)
        self.worker.register(self.kv, NUM_BLOCKS)

    def run(self, req, blocks, computed_hint=None):
        """vLLM's schedule of one request: a load outside the step first when the scheduler asks
        for one (remote chunks, by default), then the step that computes the rest. Returns the
        tokens KVLens supplies, the request's loads and stores, and the blocks reported failed."""
        rid = req.request_id
        need = self.sched.lookup(req, 0)
        deadline = time.monotonic() + 10.0
        while need is None:  # the remote's answer is on its way: vLLM asks again at its next step
            assert time.monotonic() < deadline, "the remote lookup never answered"
            time.sleep(0.02)
            need = self.sched.lookup(req, 0)
        async_loads: list = []
        failed: set[int] = set()
        self.outcomes = []
        if need and self.sched.loads_async(rid):  # vLLM parks it in WAITING_FOR_REMOTE_KVS
            self.sched.after_alloc(req, need, list(blocks))
            async_loads, failed = self._load_outside_step(rid)
            self.sched.after_alloc(req, 0)  # scheduled again, its loaded tokens computed
        else:
            self.sched.after_alloc(req, need)
        plan = self.sched.build_plan(
            step(new=[(req, blocks, need)], num_scheduled={req.request_id: req.num_tokens - need})
        )
        self.outcomes += self.worker.load(plan)
        self.worker.save(plan)
        self.worker.flush()
        self._report()
        failed |= self.worker.take_failed_blocks()
        return need, Steps(plan.loads + async_loads, plan.stores), failed

    def _load_outside_step(self, rid: str, timeout_s: float = 10.0):
        jobs, failed = [], set()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            plan = self.sched.build_plan(step())
            jobs += [j for j in plan.async_loads if j.request_id == rid]
            self.worker.load(plan)
            self.worker.save(plan)
            received, done = self.worker.take_finished_loads(idle=True)
            self.outcomes += [outcome for _, outcome in done]
            failed |= self.worker.take_failed_blocks()
            self._report()
            if rid in received:
                return jobs, failed
        raise AssertionError(f"{rid}'s load never finished")

    def _report(self) -> None:
        report = self.worker.take_report()
        if report is not None:
            self.sched.on_worker_report(report)

    def close(self):
        self.sched.shutdown()
        self.worker.shutdown()


def test_a_prefix_one_engine_stored_is_loaded_from_redis_by_another(redis_server):
    a, b = (
        Engine(redis_server.url, remote_key_prefix="share1"),
        Engine(redis_server.url, remote_key_prefix="share1"),
    )
    try:
        _, plan, _ = a.run(request("x", PROMPT), list(range(0, 5)))
        assert all(REMOTE in j.tiers for j in plan.stores)
        need, plan, failed = b.run(request("y", PROMPT), list(range(10, 15)))
        assert need == FULL_HIT and not failed
        assert [c.tier for c in plan.loads[0].chunks] == [REMOTE, REMOTE, REMOTE]
        for name in a.kv:  # b's blocks hold exactly what a computed
            assert torch.equal(b.kv[name][10:15], a.kv[name][0:5])
        # The chunks are kept in b's CPU tier: the next request loads them from there.
        need, plan, _ = b.run(request("z", PROMPT), list(range(20, 25)))
        assert [c.tier for c in plan.loads[0].chunks] == [CPU, CPU, CPU]
    finally:
        a.close()
        b.close()


def chunk_gets_during(redis_server, prefix: str, action):
    """``action()``'s result and the GETs of chunk records under ``prefix`` that Redis received
    while it ran, read from Redis's own MONITOR feed. Namespace marks, which both engines' writers
    read and write in the background (a slow machine finishes the first engine's after the second
    began), are other keys: a count of every GET would count them whenever they land."""
    chunk_get = re.compile(rf"^GET {re.escape(prefix)}:[0-9a-f]{{32}}\.r\d+$")
    done = f"kvlens-monitor-done-{time.monotonic_ns()}"
    seen: list[str] = []
    watching = threading.Event()

    def watch() -> None:
        with redis_server.client().monitor() as feed:
            watching.set()
            for event in feed.listen():
                if done in event["command"]:
                    return
                seen.append(event["command"])

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    assert watching.wait(10)
    try:
        result = action()
    finally:
        redis_server.client().echo(done)
        watcher.join(10)
    return result, [c for c in seen if chunk_get.match(c)]


def test_a_one_chunk_load_counts_its_redis_get_and_the_bytes_read(redis_server):
    """Checked against Redis's own count of GET calls and the record it holds."""
    one_chunk = list(range(7000, 7000 + 2 * BS + 3))  # one whole chunk and a partial tail
    a, b = (
        Engine(redis_server.url, remote_key_prefix="one"),
        Engine(redis_server.url, remote_key_prefix="one"),
    )
    try:
        a.run(request("x", one_chunk), [0, 1, 2])
        client = redis_server.client()
        (need, plan, failed), gets = chunk_gets_during(
            redis_server, "one", lambda: b.run(request("y", one_chunk), [10, 11, 12])
        )
        assert need == 2 * BS and not failed and [c.tier for c in plan.loads[0].chunks] == [REMOTE]
        (outcome,) = b.outcomes
        calls = [c for c in outcome.remote_calls if c.operation == "get"]
        assert len(calls) == len(gets) == 1
        key = f"one:{storage_name(plan.loads[0].chunks[0].name, 0)}"
        payload = codec.decode(
            memoryview(client.get(key)), storage_name(plan.loads[0].chunks[0].name, 0), "layout"
        )
        assert calls[0].nbytes == payload.nbytes == outcome.nbytes and calls[0].keys == 1
    finally:
        a.close()
        b.close()


def test_namespaces_and_prefixes_keep_tenants_apart(redis_server):
    a, b = (
        Engine(redis_server.url, remote_key_prefix="tenant-a"),
        Engine(redis_server.url, remote_key_prefix="tenant-b"),
    )
    try:
        a.run(request("x", PROMPT), list(range(0, 5)))
        assert b.sched.lookup(request("y", PROMPT), 0) == 0
        c = Engine(redis_server.url, remote_key_prefix="tenant-a")
        assert c.sched.lookup(request("y", PROMPT, cache_salt="other"), 0) == 0
        c.close()
    finally:
        a.close()
        b.close()


def test_a_stopped_redis_costs_misses_and_recomputes_then_recovers(server_factory):
    server = server_factory()
    a, b = Engine(server.url), Engine(server.url)
    try:
        a.run(request("x", PROMPT), list(range(0, 5)))
        assert b.sched.lookup(request("y", PROMPT), 0) == FULL_HIT  # it is there
        server.stop()
        _, plan, failed = b.run(request("y", PROMPT), list(range(10, 15)))  # looked up before the stop
        assert failed  # the load found Redis gone: vLLM recomputes these blocks
        started = time.monotonic()
        for i in range(4):
            assert b.sched.lookup(request(f"w{i}", PROMPT[:-1] + [i]), 0) == 0
        assert time.monotonic() - started < 2.0  # bounded: no hang per lookup
        assert b.sched.tier_states[REMOTE] is TierState.SKIPPED or not b.sched.usable(REMOTE)
        # refused, not timed out: never not_stored (nothing says Redis lacks it), nor lookup_timeout
        assert b.sched.lookups["w3"].miss_reason is MissReason.TIER_UNHEALTHY
        server.start()  # empty: Redis kept nothing
        other = list(range(5000, 5000 + 4 * BS))
        a.run(request("x2", other), list(range(0, 4)))  # new chunks reach the restarted Redis
        deadline = time.monotonic() + 10
        need = 0
        while time.monotonic() < deadline and need == 0:  # the lookup client probes with backoff
            time.sleep(0.3)
            need = b.sched.lookup(request(f"again{time.monotonic()}", other + [7]), 0)
        assert need == 4 * BS
    finally:
        a.close()
        b.close()


def test_a_store_planned_while_redis_is_skipped_still_names_it_so_what_redis_lacks_is_counted(redis_server):
    """The scheduler learns of a skipped Redis a step or more after the worker: a store planned
    meanwhile must still name Redis, for the worker to write it (back already) or count it
    (tier_unhealthy); leaving Redis out made those chunks vanish from every count."""
    a = Engine(redis_server.url)
    try:
        a.sched.on_worker_report(WorkerReport(tier_states={REMOTE: TierState.SKIPPED}))
        assert not a.sched.usable(REMOTE)
        _, steps, _ = a.run(request("x", PROMPT), list(range(0, 5)))
        assert steps.stores and all(REMOTE in job.tiers for job in steps.stores)
    finally:
        a.close()


def corrupt_in_place(client, key: bytes) -> None:
    """The value's last four bytes changed where Redis holds it (its length stays the same)."""
    client.setrange(key, client.strlen(key) - 4, b"\x00\x01\x02\x03")


def test_a_chunk_redis_evicted_or_corrupted_is_a_failed_block_not_wrong_kv(redis_server):
    a, b = (
        Engine(redis_server.url, remote_key_prefix="evict"),
        Engine(redis_server.url, remote_key_prefix="evict"),
    )
    try:
        _, stored, _ = a.run(request("x", PROMPT), list(range(0, 5)))
        client = redis_server.client()
        _, second, tail = (f"evict:{storage_name(job.name, 0)}".encode() for job in stored.stores)
        corrupt_in_place(client, second)
        client.delete(tail)  # as if Redis evicted it
        before = {n: t.clone() for n, t in b.kv.items()}
        _, plan, failed = b.run(request("y", PROMPT), list(range(10, 15)))
        assert failed and plan.loads
        for name in b.kv:  # nothing from a corrupt or missing value reached vLLM's blocks
            for block in failed:
                assert torch.equal(b.kv[name][block], before[name][block])
    finally:
        a.close()
        b.close()


def test_a_corrupt_value_is_not_looked_up_again_and_is_deleted(redis_server):
    a, b = (
        Engine(redis_server.url, remote_key_prefix="again"),
        Engine(redis_server.url, remote_key_prefix="again"),
    )
    try:
        _, stored, _ = a.run(request("x", PROMPT), list(range(0, 5)))
        client = redis_server.client()
        first = f"again:{storage_name(stored.stores[0].name, 0)}".encode()
        corrupt_in_place(client, first)
        _, _, failed = b.run(request("y", PROMPT), list(range(10, 15)))
        assert failed
        # vLLM reschedules a request whose asynchronous load failed and asks again: the same
        # damaged value must not be offered again (or the request would load it forever)
        assert b.sched.lookup(request("y", PROMPT), 0) == 0
        assert b.sched.lookups["y"].hit_tokens == 0
        b.worker.save(b.sched.build_plan(step()))  # the next plan deletes the damaged value
        b.worker.flush()
        assert not client.exists(first)
    finally:
        a.close()
        b.close()


def test_redis_cluster_shares_kv_too(redis_cluster):
    a, b = Engine(redis_cluster.url), Engine(redis_cluster.url)
    try:
        a.run(request("x", PROMPT), list(range(0, 5)))
        need, plan, failed = b.run(request("y", PROMPT), list(range(10, 15)))
        assert need == FULL_HIT and not failed and plan.loads[0].chunks[0].tier == REMOTE
    finally:
        a.close()
        b.close()
