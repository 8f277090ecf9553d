"""The remote tier's connections are opened at start-up and re-opened in the background: a lookup
never pays for one inside its budget, and a Redis down at start-up costs the engine nothing."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from bench.lib.ports import free_port
from connector.engine.outcomes import MissReason, TierState
from connector.scheduler.remote_lookup import RemoteLookup
from connector.tiers.redis_tier import RedisTier
from connector.tiers.remote_url import parse_remote_url

from .slow_resp import SlowResp

BUDGET_S = 0.2  # the lookup client's socket timeouts (remote_lookup_timeout_ms)


def client(url: str, read_s: float = BUDGET_S) -> RedisTier:
    return RedisTier(parse_remote_url(url), "layout", "kvlens", None, read_s, BUDGET_S)


def eventually(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_lookup_client_connects_at_start_up_so_the_first_lookup_is_one_round_trip():
    """On a loaded host each round trip costs time; opening a connection costs three (HELLO, the
    handshake's pipelined CLIENT commands, then the command). The first lookup used to pay them."""
    server = SlowResp(delay_s=0.06)
    lookup = RemoteLookup(client(server.url), world_size=1, budget_s=BUDGET_S)
    try:
        assert server.connections == 1  # opened by the start-up, before any request
        started = time.perf_counter()
        answer = lookup.present("first", ["x"])
        took = time.perf_counter() - started
        assert answer.present == [True] and answer.unanswered is None
        assert took < 2 * server.delay_s, took  # one round trip, no handshake
        assert server.connections == 1
    finally:
        lookup.close()
        server.close()


def test_a_host_slow_for_a_moment_at_start_up_still_connects_before_any_request():
    """A start-up on a loaded host (engines starting beside it): the first handshakes take longer
    than a lookup's budget, then Redis answers in time. Start-up has time a lookup has not: the
    connection is open when the engine starts serving, and the tier is not skipped (which costs
    every request its remote hits until a probe a backoff later)."""
    server = SlowResp(delay_s=3 * BUDGET_S)
    threading.Timer(0.5, lambda: setattr(server, "delay_s", 0.0)).start()
    lookup = RemoteLookup(client(server.url), world_size=1, budget_s=BUDGET_S)
    try:
        assert lookup.health.state is TierState.HEALTHY
        assert lookup.connected()
        answer = lookup.present("first", ["x"])
        assert answer.present == [True] and answer.unanswered is None
    finally:
        lookup.close()
        server.close()


def test_a_redis_down_at_start_up_is_skipped_and_reconnected_in_the_background():
    port = free_port()
    clock = Clock()
    lookup = RemoteLookup(
        client(f"redis://127.0.0.1:{port}/0"), world_size=1, clock=clock, budget_s=BUDGET_S, keepalive_s=0.02
    )
    server = None
    try:
        assert lookup.health.state is TierState.SKIPPED  # counted as the tier's health
        started = time.perf_counter()
        answer = lookup.present("while-down", ["x"])
        assert time.perf_counter() - started < BUDGET_S  # no connect attempt inside the lookup
        assert answer.present == [False] and answer.unanswered is MissReason.TIER_UNHEALTHY
        server = SlowResp(port=port)

        def probed_until_healthy() -> bool:
            # past any backoff: the keeper probes again (on a loaded host one probe may miss the
            # client's tens of milliseconds and be retried after the next backoff)
            clock.now += 61.0
            return lookup.health.state is TierState.HEALTHY

        assert eventually(probed_until_healthy)  # no lookup asked
        opened = server.connections
        assert opened >= 1
        assert lookup.present("after", ["x"]).present == [True]
        assert server.connections == opened  # the lookup used the keeper's connection
    finally:
        lookup.close()
        if server is not None:
            server.close()


def test_a_connection_lost_later_is_reopened_in_the_background():
    server = SlowResp()
    lookup = RemoteLookup(client(server.url), world_size=1, budget_s=BUDGET_S, keepalive_s=0.02)
    try:
        assert server.connections == 1
        server.drop_connections()  # a restarted server, a proxy that closed idle connections
        assert eventually(lambda: server.connections == 2)  # re-opened with no lookup
        assert eventually(lookup.connected)
        server.delay_s = 0.06
        started = time.perf_counter()
        assert lookup.present("after", ["x"]).present == [True]
        assert time.perf_counter() - started < 2 * server.delay_s
        assert server.connections == 2
    finally:
        lookup.close()
        server.close()


def test_a_lookup_that_finds_no_open_connection_asks_nothing_and_wakes_the_keeper():
    """After a timeout redis-py drops the connection: the next lookup must not open one."""
    server = SlowResp()
    lookup = RemoteLookup(client(server.url), world_size=1, budget_s=BUDGET_S, keepalive_s=None)
    try:
        server.delay_s = 2 * BUDGET_S
        timed_out = lookup.present("slow", ["x"])
        while timed_out.pending:  # awaited past the call's budget, until the client's timeout
            time.sleep(0.01)
            timed_out = lookup.present("slow", ["x"])
        assert timed_out.unanswered is MissReason.LOOKUP_TIMEOUT and timed_out.call is not None
        assert timed_out.call.error == "timeout"
        server.delay_s = 0.0
        assert not lookup.connected()
        skipped = lookup.present("next", ["y"])
        assert skipped.unanswered is MissReason.LOOKUP_TIMEOUT and skipped.call is None
        assert server.connections == 1  # the lookup opened none
        lookup.tend()  # the keeper's pass
        assert server.connections == 2 and lookup.connected()
        assert lookup.present("then", ["y"]).present == [True]
    finally:
        lookup.close()
        server.close()


def test_the_worker_clients_connect_at_start_up_and_a_redis_down_then_is_skipped():
    """Loads and stores go through the worker's own client: it connects before the first of them,
    and a Redis down at start-up marks the tier skipped for the probes to bring back."""
    import torch

    from connector.config.loading import load_config
    from connector.engine.facts import EngineFacts
    from connector.engine.jobs import REMOTE
    from connector.worker.connector_worker import ConnectorWorker

    def worker(url: str) -> ConnectorWorker:
        config = load_config({"lmcache.chunk_size": 32, "lmcache.remote_url": url}, env={})
        w = ConnectorWorker(config, EngineFacts("m", "bf16", 16, 1, 128, "layout", 1, "kv_both"), rank=0)
        w.register({"layer.0": torch.zeros(8, 16, 2)}, 8)
        return w

    server = SlowResp()
    up, down = worker(server.url), worker(f"redis://127.0.0.1:{free_port()}/0")
    try:
        assert eventually(lambda: server.connections >= 1)  # before any load or store
        assert eventually(lambda: down.health[REMOTE].state is TierState.SKIPPED)
        assert up.health[REMOTE].state is TierState.HEALTHY
    finally:
        up.shutdown(0.1)
        down.shutdown(0.1)
        server.close()


@contextlib.contextmanager
def awaited_lookup(delay_s: float, wait_s: float) -> Iterator[RemoteLookup]:
    """A lookup client whose calls wait 0.05 s and whose requests wait ``wait_s`` for a Redis
    that answers after ``delay_s`` (once connected)."""
    server = SlowResp()
    lookup = RemoteLookup(client(server.url, read_s=5.0), world_size=1, budget_s=0.05, wait_s=wait_s)
    server.delay_s = delay_s
    try:
        yield lookup
    finally:
        lookup.close()
        server.close()


def test_a_round_trip_slower_than_the_budget_is_awaited_not_missed():
    """A loaded host answers in 0.3 s where a lookup call may wait 0.05 s: the call returns within
    its budget saying "ask again" (vLLM leaves the request waiting), and a later call has the
    answer: the request's remote hits are not lost to timing."""
    with awaited_lookup(delay_s=0.3, wait_s=5.0) as lookup:
        started = time.perf_counter()
        first = lookup.present("slow", ["x"])
        took = time.perf_counter() - started
        assert first.pending and first.unanswered is None and first.present == [False]
        assert took < 0.25, took  # the scheduler's step was not held for the round trip
        assert lookup.waiting() == 1
        assert eventually(lambda: not lookup.present("slow", ["x"]).pending)
        answer = lookup.present("slow", ["x"])
        assert answer.present == [True] and answer.unanswered is None and not answer.pending
        assert lookup.waiting() == 0


def test_a_request_waits_for_its_answer_no_longer_than_the_wait_bound():
    with awaited_lookup(delay_s=3.0, wait_s=0.3) as lookup:
        assert lookup.present("stuck", ["x"]).pending
        answers = []

        def answered() -> bool:
            answers.append(lookup.present("stuck", ["x"]))
            return not answers[-1].pending

        assert eventually(answered)
        assert answers[-1].unanswered is MissReason.LOOKUP_TIMEOUT and answers[-1].present == [False]
        assert lookup.waiting() == 0


def test_a_request_that_ends_while_its_answer_is_awaited_leaves_nothing_behind():
    with awaited_lookup(delay_s=0.3, wait_s=5.0) as lookup:
        assert lookup.present("gone", ["x"]).pending
        lookup.forget("gone")  # the request finished (aborted) before its answer came
        assert lookup.waiting() == 0
        assert eventually(lambda: lookup.present("next", ["y"]).present == [True], timeout_s=5.0)


def test_the_scheduler_asks_again_instead_of_missing_a_slow_remotes_hits():
    """At KVLens's default settings (a lookup call waits 50 ms; a round trip may take up to
    remote_timeout_s), a Redis that answers in 150 ms: vLLM is told "not yet" (None) and, asked
    again, gets the remote's hits; it used to get 0 (lookup_timeout) and recompute the prompt."""
    from connector.config.loading import load_config
    from connector.engine.facts import EngineFacts
    from connector.engine.jobs import REMOTE
    from connector.scheduler.connector_scheduler import ConnectorScheduler

    from . import fakes

    server = SlowResp()
    config = load_config({"lmcache.remote_url": server.url}, env={})
    sched = ConnectorScheduler(config, EngineFacts("tiny", "bf16", 128, 2, 1000, "l", 1, "kv_both"))
    try:
        server.delay_s = 0.15
        req = fakes.request("slow", list(range(1000, 1600)), trace_headers=None)
        answers = [sched.lookup(req, 0)]
        assert answers == [None]
        assert eventually(lambda: answers.append(sched.lookup(req, 0)) or answers[-1] is not None)
        assert answers[-1] >= 512  # its two whole chunks (and what else the remote holds) load
        assert {hit.tier for hit in sched.lookups[req.request_id].hits} == {REMOTE}
        sched.finish(req)
        assert sched.state.remote.waiting() == 0
    finally:
        sched.shutdown()
        server.close()
