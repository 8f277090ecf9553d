"""Real ``vllm serve`` (CPU) with KVLens's CPU tier: traces in the client's trace, the
kvlens breakdown in responses, vllm:kvlens_* on vLLM's /metrics, gauges that drain to zero."""

from __future__ import annotations

import http.client
import json
import re
import threading

import pytest

from telemetry.metrics import METRICS

from ..serve import prompt_tokens, sample, sum_samples, traceparent, wait_until

pytestmark = pytest.mark.integration

CLIENT_SPAN = "00f067aa0ba902b7"
KVLENS_SPANS = ("kvlens.lookup", "kvlens.load", "kvlens.store")
UNFINISHED = re.compile(r"^vllm:kvlens_unfinished_requests\{[^}]*\} (\S+)$", re.M)
SENTENCE = "The engineers measured the latency of the cache before and after the change. "


def spans_in_trace(receiver, trace_id, names, timeout=60.0):
    spans = receiver.wait_for(
        lambda got: set(names) <= {s.name for s in got if s.trace_id == trace_id}, timeout=timeout
    )
    by_name: dict[str, list] = {}
    for s in spans:
        if s.trace_id == trace_id:
            by_name.setdefault(s.name, []).append(s)
    return by_name


def no_token_ids(span, prompt):
    window = {tuple(prompt[i : i + 8]) for i in range(0, len(prompt) - 8)}
    for value in span.attributes.values():
        if isinstance(value, list) and len(value) >= 8:
            assert not any(tuple(value[i : i + 8]) in window for i in range(len(value) - 7)), span.name


def test_request_with_traceparent_gets_lookup_load_and_store_spans_in_its_trace(serve_stack):
    srv, rx = serve_stack.server, serve_stack.receiver
    cold_trace, trace = "a1" * 16, "b2" * 16
    a = prompt_tokens(600, 11)
    srv.complete(a, traceparent=traceparent(cold_trace))
    srv.reset_prefix_cache()
    b = a[:512] + prompt_tokens(300, 12)  # two stored chunks, then a new one to store
    response = srv.complete(b, traceparent=traceparent(trace))

    spans = spans_in_trace(rx, trace, KVLENS_SPANS + ("llm_request",))
    for name in KVLENS_SPANS:
        assert len(spans[name]) == 1, f"one {name} span per request"
    lookup, load, store = (spans[n][0] for n in KVLENS_SPANS)
    for span in (lookup, load, store, spans["llm_request"][0]):
        assert span.parent_span_id == CLIENT_SPAN  # siblings of vLLM's llm_request
        no_token_ids(span, b)
    rid = lookup.attributes["kvlens.request_id"]
    assert rid.startswith(response["id"]) and load.attributes["kvlens.request_id"] == rid
    assert store.attributes["kvlens.request_id"] == rid
    assert lookup.resource.get("vllm.process_kind") == "engine_core"
    assert load.resource.get("vllm.process_kind") == "worker"

    la = lookup.attributes
    assert la["kvlens.prompt_tokens"] == 812 and la["kvlens.vllm_cached_tokens"] == 0
    assert la["kvlens.hit_tokens"] == 512 and la["kvlens.external_tokens"] == 512
    assert (
        la["kvlens.chunks"] == 2
        and la["kvlens.tiers"] == ["cpu"]
        and la["kvlens.miss_reason"] == "not_stored"
    )
    assert la["gen_ai.request.model"] == "tiny" and la["gen_ai.usage.cache_read.input_tokens"] == 512
    ld = load.attributes
    assert ld["kvlens.loaded_tokens"] == 512 and ld["kvlens.planned_tokens"] == 512
    assert ld["kvlens.bytes"] > 0 and ld["kvlens.chunks"] == 2 and ld["kvlens.tiers"] == ["cpu"]
    assert ld["kvlens.failed_blocks"] == 0 and load.status_code != 2
    st = store.attributes
    assert st["kvlens.stored_tokens"] == 256 and st["kvlens.chunks"] == 1 and st["kvlens.bytes"] > 0
    assert lookup.start_ns <= lookup.end_ns <= load.start_ns <= load.end_ns

    cold = spans_in_trace(rx, cold_trace, ("kvlens.lookup", "kvlens.store"))
    assert cold["kvlens.lookup"][0].attributes["kvlens.hit_tokens"] == 0
    assert cold["kvlens.store"][0].attributes["kvlens.stored_tokens"] == 512
    assert "kvlens.load" not in cold


def test_stores_spread_over_prefill_steps_make_one_store_span(serve_stack):
    srv, rx = serve_stack.server, serve_stack.receiver
    trace = "c3" * 16
    srv.complete(prompt_tokens(1100, 21), traceparent=traceparent(trace))
    (store,) = spans_in_trace(rx, trace, ("kvlens.store",))["kvlens.store"]
    assert store.attributes["kvlens.chunks"] == 4 and store.attributes["kvlens.stored_tokens"] == 1024
    assert store.attributes["kvlens.steps"] >= 2


def test_responses_carry_the_kvlens_breakdown(serve_stack):
    srv = serve_stack.server
    a = prompt_tokens(600, 31)
    cold = srv.complete(a)["kv_transfer_params"]
    assert cold["num_lmcache_cached_tokens"] == 0 and cold["kvlens"]["miss_reason"] == "not_stored"
    local = srv.complete(a)["kv_transfer_params"]["kvlens"]  # vLLM's own prefix cache has it
    assert local["vllm_cached_tokens"] == 512 and local["loaded_tokens"] == {}
    srv.reset_prefix_cache()
    hit = srv.complete(a)["kv_transfer_params"]
    assert hit["num_lmcache_cached_tokens"] == 512
    k = hit["kvlens"]
    assert k["vllm_cached_tokens"] == 0 and k["loaded_tokens"] == {"cpu": 512} and k["load_ms"] > 0
    assert k["failed_blocks"] == 0 and k["recomputed_tokens"] == 0 and k["miss_reason"] == "partial_chunk"
    srv.reset_prefix_cache()
    # One token: vLLM frees the request before it reads that step's load report.
    one = srv.complete(a, max_tokens=1)["kv_transfer_params"]["kvlens"]
    assert one["loaded_tokens"] == {"cpu": 512} and one["load_ms"] > 0


def test_chat_completion_responses_carry_the_breakdown(serve_stack):
    srv = serve_stack.server
    body = {
        "model": "tiny",
        "max_tokens": 4,
        "temperature": 0.0,
        "messages": [{"role": "user", "content": SENTENCE * 30}],
    }
    first = srv.post("/v1/chat/completions", body)["kv_transfer_params"]
    srv.reset_prefix_cache()
    second = srv.post("/v1/chat/completions", body)["kv_transfer_params"]
    assert first["kvlens"]["loaded_tokens"] == {}
    assert second["num_lmcache_cached_tokens"] >= 256
    assert second["kvlens"]["loaded_tokens"]["cpu"] == second["num_lmcache_cached_tokens"]


def test_cache_salt_and_request_params_from_the_http_body(serve_stack):
    srv = serve_stack.server
    p = prompt_tokens(600, 77)
    srv.complete(p, cache_salt="tenant-a")
    srv.reset_prefix_cache()
    other = srv.complete(p, cache_salt="tenant-b")["kv_transfer_params"]
    assert other["num_lmcache_cached_tokens"] == 0  # salted tenants never share KV
    srv.reset_prefix_cache()
    assert srv.complete(p, cache_salt="tenant-a")["kv_transfer_params"]["num_lmcache_cached_tokens"] == 512

    q = prompt_tokens(600, 78)
    skipped = srv.complete(q, kv_transfer_params={"lmcache.skip_save": True})["kv_transfer_params"]
    assert skipped["kvlens"]["save_skip_reason"] == "skip_save"
    srv.reset_prefix_cache()
    assert srv.complete(q)["kv_transfer_params"]["num_lmcache_cached_tokens"] == 0
    srv.reset_prefix_cache()
    # A malformed per-request parameter: the request is served, without KVLens.
    bad = srv.complete(q, kv_transfer_params={"lmcache.tag.user": {"not": "a string"}})
    assert len(bad["choices"][0]["text"]) > 0
    assert bad["kv_transfer_params"]["num_lmcache_cached_tokens"] == 0


def test_kvlens_series_are_on_vllms_metrics_endpoint(serve_stack):
    srv = serve_stack.server
    text = srv.metrics_text()
    for metric in METRICS.values():
        assert f"# TYPE {metric.name}" in text, metric.name
    before = srv.samples()
    a = prompt_tokens(600, 41)  # two whole chunks and an 88-token tail (less than a block)
    srv.complete(a)
    srv.reset_prefix_cache()
    srv.complete(a)

    def grew(name, by, **labels):
        return sum_samples(srv.samples(), name, **labels) - sum_samples(before, name, **labels) >= by

    wait_until(lambda: grew("vllm:kvlens_load_tokens_total", 512, tier="cpu"), what="load tokens counted")
    after = srv.samples()

    def delta(name, **labels):
        return sum_samples(after, name, **labels) - sum_samples(before, name, **labels)

    assert delta("vllm:kvlens_lookup_requests_total") == 2
    assert delta("vllm:kvlens_lookup_tokens_total") == 1200
    assert delta("vllm:kvlens_hit_tokens_total", tier="cpu") == 512
    assert delta("vllm:kvlens_hit_requests_total") == 1
    assert delta("vllm:kvlens_miss_requests_total", reason="not_stored") == 1
    assert delta("vllm:kvlens_load_requests_total") == 1
    assert delta("vllm:kvlens_load_bytes_total") > 0
    assert delta("vllm:kvlens_store_tokens_total", tier="cpu") == 512
    assert delta("vllm:kvlens_store_chunks_total", tier="cpu") == 2
    for op, n in (("lookup", 2), ("load", 1), ("store", 1)):
        assert delta("vllm:kvlens_operation_seconds_count", operation=op) == n, op
    assert delta("vllm:kvlens_request_hit_ratio_count") == 2
    # Hit rate comes from the counter pair, and vLLM credits the tokens to host memory.
    assert delta("vllm:kvlens_hit_tokens_total") / delta("vllm:kvlens_lookup_tokens_total") == 512 / 1200
    assert delta("vllm:prompt_tokens_cached_by_source_total", source="host") == 512
    assert sample(after, "vllm:kvlens_tier_capacity_bytes", tier="cpu", storage="") == 1024**3
    assert sample(after, "vllm:kvlens_tier_used_bytes", tier="cpu", storage="") > 0


def _abandoned_stream(srv, prompt):
    """A streaming request the client walks away from: vLLM aborts it."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    body = json.dumps(
        {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 400,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0.0,
        }
    )
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.readline()
    conn.close()


def test_trackers_and_pins_return_to_zero_after_the_workload_drains(serve_stack):
    srv = serve_stack.server
    shared = prompt_tokens(512, 51)
    srv.complete(shared + prompt_tokens(40, 52))
    srv.reset_prefix_cache()
    peak = {"unfinished": 0.0}
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            match = UNFINISHED.search(srv.metrics_text())
            peak["unfinished"] = max(peak["unfinished"], float(match.group(1)) if match else 0.0)
            stop.wait(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    workers = [
        threading.Thread(
            target=srv.complete,
            args=(shared + prompt_tokens(100 + 50 * i, 60 + i),),
            kwargs={"max_tokens": 160},
        )
        for i in range(6)
    ]
    workers += [
        threading.Thread(target=_abandoned_stream, args=(srv, shared + prompt_tokens(90, 70 + i)))
        for i in range(2)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=180)
    stop.set()
    watcher.join(timeout=10)
    assert peak["unfinished"] >= 1  # the gauges do move

    drained = (
        "request_trackers",
        "load_specs",
        "pending_saves",
        "unfinished_requests",
        "invalid_block_ids",
        "pinned_requests",
        "telemetry_open_requests",
    )

    def all_zero():
        s = srv.samples()
        values = {n: sample(s, f"vllm:kvlens_{n}") for n in drained}
        values["pinned_chunks"] = sample(s, "vllm:kvlens_pinned_chunks", tier="cpu")
        values["pinned_bytes"] = sample(s, "vllm:kvlens_pinned_bytes", tier="cpu")
        return values if all(v == 0 for v in values.values()) else None

    wait_until(all_zero, timeout=60, what="KVLens trackers and pins back to zero")
