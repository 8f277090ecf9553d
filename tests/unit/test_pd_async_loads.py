"""The decoder's PD loads are vLLM asynchronous loads, driven through both halves without vLLM: a
real receiver on loopback holds records a sender wrote (one of them not whole blocks), the
scheduler half answers the lookup ``(n, True)`` and plans the load at allocation, the worker half
copies from the shared-memory buffer into a real KV cache and reports the request finished with
the failed blocks in the same step, and the claim is released once whatever the order of the
report and the request's end. vLLM caches an asynchronous load's blocks only when it is reported
and only up to the first failed block, so a failed record never reaches its prefix cache."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from bench.lib.ports import free_port
from connector.config.loading import load_config
from connector.engine.facts import EngineFacts
from connector.engine.keys import PrefixHasher
from connector.pd.sender import PDSender
from connector.pd_roles import SchedulerPD, WorkerPD, identity, key_space
from connector.worker.kv_blocks import BlockCopier

from .pd_wire_support import send, wait_until

CHUNK, BLOCK, LAYERS, HEADS, HEAD2 = 256, 128, 2, 2, 16
BLOCK_BYTES = HEADS * BLOCK * HEAD2 * 2  # one layer's block, bf16
RECORD_BLOCK = LAYERS * BLOCK_BYTES  # one block of every layer, as a record holds it
FACTS = EngineFacts("model", "bfloat16", BLOCK, LAYERS, BLOCK_BYTES, "layout", 1, "kv_consumer")
PROMPT = list(range(7, 7 + CHUNK * 2 + 77))  # two chunks and a 77-token tail, as the prefiller sent
NUM_BLOCKS = 16


class Recorder:
    """The PD recorder's part the decoder feeds: one ``load_reported`` per load (pd_loads_total)."""

    def __init__(self) -> None:
        self.loads: list[dict] = []

    def load_reported(self, trace_context, pd) -> None:
        self.loads.append(pd)


def keys() -> list[str]:
    return [k.hex for k in PrefixHasher(FACTS.namespace(), CHUNK).keys(PROMPT, True, len(PROMPT))]


@contextlib.contextmanager
def decoder(facts: EngineFacts = FACTS) -> Iterator[tuple[SchedulerPD, WorkerPD, BlockCopier, Recorder]]:
    ports = {"lmcache.pd_peer_init_port": [free_port()], "lmcache.pd_peer_alloc_port": [free_port()]}
    settings = {
        "lmcache.local_cpu": False,
        "lmcache.enable_pd": True,
        "lmcache.transfer_channel": "tcp",
        "lmcache.pd_role": "receiver",
        "lmcache.pd_peer_host": "127.0.0.1",
        "lmcache.pd_buffer_size": 1 << 20,
        "lmcache.pd_buffer_device": "cpu",
        **ports,
    }
    config = load_config(settings, env={})
    recorder = Recorder()
    hashers = {rid: PrefixHasher(FACTS.namespace(), CHUNK) for rid in ("d-1", "d-2")}
    sched = SchedulerPD(config, facts, hashers, recorder)
    worker = WorkerPD(config, facts, 0)
    kv = {f"layer.{i}": torch.zeros(NUM_BLOCKS, HEADS, BLOCK, HEAD2, dtype=torch.bfloat16) for i in range(2)}
    try:
        yield sched, worker, BlockCopier(kv, NUM_BLOCKS), recorder
    finally:
        worker.shutdown()
        sched.shutdown()


def receive(sched: SchedulerPD, records: list[bytes]) -> None:
    """A prefiller's transfer of PROMPT's chunks with these records, indexed by the receiver."""
    sender = PDSender(identity(key_space(FACTS), FACTS, CHUNK, 0), 5.0, 5.0)
    try:
        port = sched.decoder.receiver.init_ports[0]
        outcome = send(sender, port, records, keys=keys(), tokens=CHUNK)
        assert outcome.ok, outcome
    finally:
        sender.close()


def record(blocks: int, fill: int) -> bytes:
    return bytes([fill]) * (blocks * RECORD_BLOCK)


def request(rid: str) -> SimpleNamespace:
    tokens = [*PROMPT, 999]  # the proxy appends the prefiller's first token
    return SimpleNamespace(request_id=rid, num_prompt_tokens=len(tokens), all_token_ids=tokens)


def step(sched: SchedulerPD, worker: WorkerPD, copier: BlockCopier) -> tuple[set[str], set[int]]:
    """One engine step with nothing to compute: the plan goes to the worker, which loads and
    reports; (vLLM's finished_recving, its invalid block ids) of that step's output."""
    sends, loads = sched.plan(SimpleNamespace(total_num_scheduled_tokens=0), {}, {})
    failed: set[int] = set()
    worker.load(loads, copier, failed)
    finished = worker.take_received()
    results, _ = worker.take()
    sched.on_worker_meta(results, [])
    return finished, failed


def claims(sched: SchedulerPD) -> int:
    return sched.decoder.receiver.stats().claims


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_the_lookup_is_an_asynchronous_load_whatever_the_failure_policy(policy):
    facts = dataclasses.replace(FACTS, failed_blocks_stay_cached=policy == "recompute")
    with decoder(facts) as (sched, _, _, _):
        receive(sched, [record(2, 1), record(2, 2), record(1, 3)])
        assert sched.lookup(request("d-1"), 0, 0) == (CHUNK * 2 + 77, True)
        assert sched.lookup(request("d-1"), BLOCK, 0) == (CHUNK * 2 + 77 - BLOCK, True)
        assert sched.lookup(request("d-1"), 0, CHUNK * 3) is None  # the tiers' hit is longer


def test_a_record_not_whole_blocks_fails_its_blocks_and_later_ones_reported_with_the_request():
    with decoder() as (sched, worker, copier, recorder):
        receive(sched, [record(2, 1), bytes(RECORD_BLOCK * 2 - 100), record(1, 3)])
        req = request("d-1")
        need, asynchronous = sched.lookup(req, 0, 0)
        assert asynchronous and sched.after_alloc(req, need, [3, 4, 5, 6, 7])
        assert sched.hit_tokens("d-1") == need and claims(sched) == 1
        finished, failed = step(sched, worker, copier)
        assert finished == {"d-1"} and failed == {5, 6, 7}  # in the same step's output
        assert copier.gather([3, 4]).eq(1).all() and not copier.gather([5, 6, 7]).any()
        assert claims(sched) == 0 and sched.decoder.receiver.stats().entries == 0  # released, freed
        assert sched.readmitted("d-1")  # vLLM schedules it once more: not a new lookup
        assert sched.lookup(req, 0, 0) is None  # nor does it load again
        pd = sched.finish(req, None, [])[0]["kvlens"]["pd"]
        assert (pd["outcome"], pd["reason"], pd["tokens"]) == ("failed", "load_failed", CHUNK)
        assert [p["outcome"] for p in recorder.loads] == ["failed"]


def test_a_good_load_counts_every_token_it_loaded():
    with decoder() as (sched, worker, copier, recorder):
        receive(sched, [record(2, 1), record(2, 2), record(1, 3)])
        req = request("d-1")
        need, _ = sched.lookup(req, 0, 0)
        sched.after_alloc(req, need, [3, 4, 5, 6, 7])
        assert step(sched, worker, copier) == ({"d-1"}, set())
        assert copier.gather([5, 6]).eq(2).all() and copier.gather([7]).eq(3).all()
        pd = sched.finish(req, None, [])[0]["kvlens"]["pd"]
        assert (pd["outcome"], pd["tokens"]) == ("loaded", need)  # vLLM counts `need` as P2P hits
        assert [p["outcome"] for p in recorder.loads] == ["loaded"]


@pytest.mark.parametrize("abort", ["before_the_step", "after_the_copy"])
def test_an_abort_while_the_load_is_out_releases_the_claim_once_on_the_report(abort):
    with decoder() as (sched, worker, copier, recorder):
        receive(sched, [record(2, 1), record(2, 2), record(1, 3)])
        req = request("d-1")
        need, _ = sched.lookup(req, 0, 0)
        sched.after_alloc(req, need, [3, 4, 5, 6, 7])
        _, loads = sched.plan(SimpleNamespace(total_num_scheduled_tokens=0), {}, {})
        if abort == "before_the_step":  # vLLM's asynchronous scheduling: the abort beats the copy
            sched.finish(req, None, [])
        worker.load(loads, copier, set())
        if abort == "after_the_copy":  # mid-load: the copy is done, its report not in yet
            sched.finish(req, None, [])
        assert claims(sched) == 1  # the workers may be reading the slots until they report
        assert worker.take_received() == {"d-1"}  # vLLM frees the blocks on this report
        results, _ = worker.take()
        sched.on_worker_meta(results, [])
        sched.on_worker_meta(results, [])  # the same report twice changes nothing
        assert claims(sched) == 0 and sched.decoder.receiver.stats().entries == 0
        assert len(recorder.loads) == 1 and not sched.readmitted("d-1")


def test_records_that_expired_between_lookup_and_allocation_end_the_load_failed_not_waiting():
    with decoder() as (sched, worker, copier, recorder):
        receive(sched, [record(2, 1), record(2, 2), record(1, 3)])
        req = request("d-1")
        need, _ = sched.lookup(req, 0, 0)
        sched.decoder.receiver.claim(keys(), "other")
        sched.decoder.receiver.release("other")  # another request loaded them: freed meanwhile
        assert sched.after_alloc(req, need, [3, 4, 5, 6, 7])
        assert step(sched, worker, copier) == ({"d-1"}, {3, 4, 5, 6, 7})
        pd = sched.finish(req, None, [])[0]["kvlens"]["pd"]
        assert (pd["outcome"], pd["reason"], pd["tokens"]) == ("failed", "claim_lost", 0)
        wait_until(lambda: sched.decoder.receiver.stats().entries == 0)
