"""Asynchronous loads (`enable_async_loading: true`) on a real `vllm serve` with a real Redis:
a request whose chunks are in Redis waits outside the batch while they load, and comes back
with vLLM's own output; a load that outlasts the tier timeout is recomputed; a request aborted
while it waits leaves no pin, tracker or load behind."""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from ..telemetry.serve import prompt_tokens, sample, wait_until
from .slow_proxy import SlowProxy
from .test_serve_remote import loaded, remote_only, serve, text, writes_landed

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def setup(server_factory_module, tiny_model, tmp_path_factory):
    redis = server_factory_module()
    proxy = SlowProxy(redis.port)
    # the proxy's hop costs more than a lookup's default 50 ms on a busy machine
    kv = remote_only(proxy.url, remote_key_prefix="async", remote_lookup_timeout_ms=1000)
    kv["kv_connector_extra_config"]["lmcache.enable_async_loading"] = True
    # loads that finish a step late are reported from the worker's process, as deployed
    srv = serve(tiny_model, tmp_path_factory.mktemp("async-loads"), "async", kv, worker_process=True)
    try:
        yield proxy, srv
    finally:
        srv.stop()
        proxy.close()


def stored(srv, seed: int) -> tuple[list[int], dict]:
    prompt = prompt_tokens(700, seed)
    cold = srv.complete(prompt, max_tokens=8)
    writes_landed(srv)
    srv.reset_prefix_cache()
    return prompt, cold


def idle(srv) -> None:
    """Nothing left pinned, tracked or loading."""
    wait_until(
        lambda: all(
            sample(srv.samples(), f"vllm:kvlens_{gauge}") == 0
            for gauge in ("pinned_requests", "request_trackers", "load_specs")
        ),
        timeout=30,
        what="no pins, trackers or lookups left",
    )


def served_from_redis(srv, prompt, cold) -> bool:
    """Asked again (vLLM's own cache emptied): vLLM's own answer, and whether Redis served it."""
    srv.reset_prefix_cache()
    again = srv.complete(prompt, max_tokens=8)
    assert text(again) == text(cold)
    return loaded(again) == {"remote": 640}


def test_a_redis_hit_loads_outside_the_batch_with_vllms_own_output(setup):
    _, srv = setup
    prompt, cold = stored(srv, 41)
    hit = srv.complete(prompt, max_tokens=8)
    assert loaded(hit) == {"remote": 640} and text(hit) == text(cold)
    idle(srv)


def test_a_load_that_outlasts_the_tier_timeout_is_recomputed_and_the_batch_goes_on(setup):
    proxy, srv = setup
    prompt, cold = stored(srv, 42)
    other = prompt_tokens(300, 142)
    proxy.delay_s = 8.0  # longer than tier_timeout_s (5 s): the load times out
    decoded: list[dict] = []
    try:
        waiter = threading.Thread(target=lambda: decoded.append(srv.complete(prompt, max_tokens=8)))
        load_asked = time.monotonic()
        waiter.start()
        time.sleep(1.0)
        beside = srv.complete(other, max_tokens=16)  # runs while the first waits for its KV
        beside_done = time.monotonic()
        waiter.join(60)
    finally:
        proxy.delay_s = 0.0
    # the batch went on: the other request finished before the stalled load's tier timeout (5 s,
    # the default) ran out, so nothing waited for it (a bound of the load's, not of this CPU's)
    assert beside["choices"][0]["text"] is not None and beside_done < load_asked + 5.0
    (out,) = decoded
    assert text(out) == text(cold)
    usage = out["kv_transfer_params"]["kvlens"]
    assert usage["failed_blocks"] > 0 and usage["miss_reason"] == "load_failed"
    assert usage["recomputed_tokens"] > 0
    idle(srv)


def test_a_request_aborted_while_its_kv_loads_leaves_nothing_behind(setup):
    proxy, srv = setup
    prompt, cold = stored(srv, 43)
    proxy.delay_s = 3.0
    try:
        host, port = srv.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        time.sleep(1.0)  # the request now waits for its KV
        conn.close()  # the client goes away: vLLM aborts the request
        time.sleep(0.5)
    finally:
        proxy.delay_s = 0.0
    idle(srv)

    # the engine serves on: from Redis once the tier is healthy
    wait_until(lambda: served_from_redis(srv, prompt, cold), timeout=90, interval=1.0, what="from Redis")
    idle(srv)


def prefill_seconds_per_token(srv) -> float:
    """What computing a prompt token costs this engine on this machine: the cost KVLens publishes
    (its own step fit), else a cold prompt timed here. Never one machine's figure written down."""
    published = sample(srv.samples(), "vllm:kvlens_prefill_seconds_per_token")
    if published:
        return published
    cold = prompt_tokens(640, 148)
    started = time.monotonic()
    srv.complete(cold, max_tokens=1)
    return (time.monotonic() - started) / len(cold)


def read_delay_slower_than_compute(srv, tokens: int) -> float:
    """A delay per large Redis read that makes loading ``tokens`` clearly slower than computing
    them here (a load is at least one delayed read), and still far inside the 5 s tier timeout."""
    compute_s = tokens * prefill_seconds_per_token(srv)
    delay_s = max(0.05, 3.0 * compute_s)
    assert delay_s <= 1.0, f"computing {tokens} tokens takes {compute_s:.2f} s: too slow to outrun a read"
    return delay_s


def test_a_tier_slower_than_recomputing_is_skipped_until_it_is_fast_again(setup):
    proxy, srv = setup
    stored_prompts = [stored(srv, seed) for seed in (44, 45, 46, 47)]
    # every large read from Redis waits long enough that a chunk loads slower than it computes,
    # on a fast or a slow CPU alike: the delay follows what this engine measured
    proxy.delay_s = read_delay_slower_than_compute(srv, 640)
    usages = []
    try:
        for prompt, cold in stored_prompts:  # loaded (and measured slow) until judged slower
            out = srv.complete(prompt, max_tokens=8)
            assert text(out) == text(cold)  # loaded or computed, vLLM's own answer
            usages.append(out["kv_transfer_params"]["kvlens"])
            if usages[-1]["miss_reason"] == "slower_than_recompute":
                break
    finally:
        proxy.delay_s = 0.0
    usage = usages[-1]
    assert usage["miss_reason"] == "slower_than_recompute" and not usage["loaded_tokens"], usages
    detail = usage["miss_detail"]
    assert detail["tier"] == "remote" and detail["load_ms"] > detail["compute_ms"]
    assert all(u["loaded_tokens"] in ({}, {"remote": 640}) for u in usages)

    # fast again: a recheck (every 10 s) measures it anew
    wait_until(lambda: served_from_redis(srv, prompt, cold), timeout=40, interval=2.0, what="from Redis")
    idle(srv)
