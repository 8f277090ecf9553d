"""Remote loads read into reused buffers; through the worker (layer-wise copy thread, promotion into
the CPU tier) a buffer something still reads is never filled by a later load."""

from __future__ import annotations

import torch

from connector.config.loading import load_config
from connector.engine.facts import EngineFacts
from connector.engine.jobs import CPU, REMOTE
from connector.scheduler.connector_scheduler import ConnectorScheduler
from connector.worker.connector_worker import ConnectorWorker
from connector.worker.kv_blocks import BlockCopier

from ..unit.fakes import request
from .test_remote_tier_connector import BS, FULL_HIT, LAYERS, NUM_BLOCKS, PROMPT, Engine, caches

OTHER = [t + 50_000 for t in PROMPT]  # a prompt of the same length: chunks of the same size


def test_chunks_kept_in_the_cpu_tier_survive_later_remote_loads(redis_server):
    a, b = (
        Engine(redis_server.url, remote_key_prefix="reuse"),
        Engine(redis_server.url, remote_key_prefix="reuse"),
    )
    try:
        a.run(request("x1", PROMPT), list(range(0, 5)))
        a.run(request("x2", OTHER), list(range(5, 10)))
        assert b.worker.copier is not None and b.worker.runner is not None  # layer-wise copies
        _, plan, failed = b.run(request("y1", PROMPT), list(range(10, 15)))
        assert not failed and {c.tier for c in plan.loads[0].chunks} == {REMOTE}
        for _ in range(3):  # same-size loads that would land in PROMPT's buffers if they were free
            _, plan, failed = b.run(request("y2", OTHER), list(range(15, 20)))
            assert not failed and plan.loads
            for name in a.kv:
                assert torch.equal(b.kv[name][15:20], a.kv[name][5:10])
        need, plan, failed = b.run(request("y3", PROMPT), list(range(20, 25)))
        assert need == FULL_HIT and not failed
        assert {c.tier for c in plan.loads[0].chunks} == {CPU}  # from the promoted copies
        for name in a.kv:
            assert torch.equal(b.kv[name][20:25], a.kv[name][0:5])
    finally:
        a.close()
        b.close()


class RemoteOnlyEngine(Engine):
    """An engine whose only tier is Redis: every hit is a remote load."""

    def __init__(self, url: str) -> None:  # noqa: D107 - Engine's, without the CPU tier
        self.kv = caches()
        copier = BlockCopier(self.kv, NUM_BLOCKS)
        facts = EngineFacts("m", "f32", BS, LAYERS, copier.block_bytes, "layout", 1, "kv_both")
        cfg = {
            "lmcache.chunk_size": 2 * BS,
            "lmcache.local_cpu": False,
            "lmcache.remote_url": url,
            "lmcache.extra_config": {"remote_key_prefix": "reuse2", "remote_timeout_s": 0.5},
        }
        config = load_config(cfg, env={})
        self.sched = ConnectorScheduler(config, facts)
        self.worker = ConnectorWorker(config, facts, rank=0)
        self.worker.register(self.kv, NUM_BLOCKS)


def test_a_remote_load_after_the_copies_reuses_the_buffer(redis_server):
    a, b = RemoteOnlyEngine(redis_server.url), RemoteOnlyEngine(redis_server.url)
    try:
        a.run(request("x1", PROMPT), list(range(0, 5)))
        remote = b.worker.tiers[REMOTE].inner
        b.run(request("y1", PROMPT), list(range(10, 15)))
        held = remote.read_buffers.bytes
        assert held > 0
        for i in range(3):
            _, plan, failed = b.run(request(f"y{i + 2}", PROMPT), list(range(15, 20)))
            assert not failed and plan.loads and plan.loads[0].chunks[0].tier == REMOTE
            for name in a.kv:
                assert torch.equal(b.kv[name][15:20], a.kv[name][0:5])
        assert remote.read_buffers.bytes == held  # each load read into the buffers of the one before
    finally:
        a.close()
        b.close()
