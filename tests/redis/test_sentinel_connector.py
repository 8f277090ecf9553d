"""KVLens's scheduler and worker halves sharing KV through the master Redis Sentinel names, as
LMCache's Redis page sets it up, before and after that master is killed."""

from __future__ import annotations

import time

import torch

from connector.engine.jobs import REMOTE

from ..unit.fakes import request
from .test_remote_tier_connector import BS, FULL_HIT, PROMPT, Engine


def test_engines_share_kv_through_sentinels_and_after_a_failover(private_sentinels):
    url = private_sentinels.url  # redis-sentinel://127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3/mymaster
    a, b = Engine(url), Engine(url)
    try:
        _, stored, _ = a.run(request("x", PROMPT), list(range(0, 5)))
        assert all(REMOTE in j.tiers for j in stored.stores)
        need, plan, failed = b.run(request("y", PROMPT), list(range(10, 15)))
        assert need == FULL_HIT and not failed and plan.loads[0].chunks[0].tier == REMOTE
        for name in a.kv:
            assert torch.equal(b.kv[name][10:15], a.kv[name][0:5])

        old = private_sentinels.current_master()
        private_sentinels.wait_replicated()
        old.kill()
        private_sentinels.wait_failover(old.port)

        c = Engine(url)  # a third engine, and a's halves, now reach the promoted replica
        try:
            other = list(range(7000, 7000 + 4 * BS))
            deadline = time.monotonic() + 20
            while True:  # a's remote tier may be skipped for a probe period after the kill
                _, plan, _ = a.run(request(f"x2-{time.monotonic()}", other), list(range(0, 4)))
                if any(REMOTE in j.tiers for j in plan.stores):
                    break
                assert time.monotonic() < deadline, "a never stored to the new master"
                time.sleep(0.3)
            a.worker.flush()
            need, plan, failed = c.run(request("z", PROMPT), list(range(20, 25)))
            assert need == FULL_HIT and not failed  # replicated before the kill
            assert [ch.tier for ch in plan.loads[0].chunks] == [REMOTE] * 3
            for name in a.kv:
                assert torch.equal(c.kv[name][20:25], a.kv[name][0:5])
            assert c.sched.lookup(request("w", other + [1]), 0) == 4 * BS
        finally:
            c.close()
    finally:
        a.close()
        b.close()
