"""Real ``vllm serve`` (CPU): the answers KVLens gives on /metrics and in its request log.

How big should the tier be (what-if curve), why did this request miss (request log), which
instances can share (info metric), do the layers agree (vLLM's external hits against tokens
KVLens loaded), and what did the cache save (prefill seconds).
"""

from __future__ import annotations

import json
import re

import pytest

from ..serve import prompt_tokens, sample, sum_samples, wait_until

pytestmark = pytest.mark.integration

FACTORS = ("0.125", "0.25", "0.5", "1", "2", "4", "8", "16")


def _labels(samples, name):
    return [dict(ls) for (n, ls) in samples if n == name]


def _log(serve_stack):
    path = serve_stack.tmp / "requests.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_one_workload_answers_sizing_sharing_reconciliation_and_savings(serve_stack):
    srv = serve_stack.server
    before = srv.samples()
    # The what-if curve counts every lookup since the server started: this test is its first
    # (the package's first module, its first test).
    assert sum_samples(before, "vllm:kvlens_lookup_requests_total") == 0, "the server has served requests"
    prompts = [prompt_tokens(600, 300 + i) for i in range(6)]
    for p in prompts:  # cold: computed, timed, stored
        srv.complete(p, max_tokens=4)
    srv.reset_prefix_cache()
    for p in prompts:  # warm: 512 tokens each from KVLens's CPU tier
        assert srv.complete(p, max_tokens=4)["kv_transfer_params"]["kvlens"]["loaded_tokens"] == {"cpu": 512}

    def delta(name, **labels):
        return sum_samples(srv.samples(), name, **labels) - sum_samples(before, name, **labels)

    wait_until(lambda: delta("vllm:kvlens_load_tokens_total") >= 6 * 512, what="loads counted")
    wait_until(lambda: delta("vllm:kvlens_prefill_seconds_saved_total", tier="cpu") > 0, what="savings")
    after = srv.samples()

    # What did the cache save: loaded tokens priced at this engine's measured cost per token.
    per_token = sample(after, "vllm:kvlens_prefill_seconds_per_token")
    assert per_token is not None and 1e-6 < per_token < 0.5
    saved = delta("vllm:kvlens_prefill_seconds_saved_total", tier="cpu")
    assert saved == pytest.approx(6 * 512 * per_token, rel=0.75)  # priced as it was measured then

    # Do the layers agree: vLLM's external hits are exactly the tokens KVLens loaded.
    loaded = delta("vllm:kvlens_load_tokens_total")
    assert delta("vllm:external_prefix_cache_hits_total") == loaded == 6 * 512
    assert delta("vllm:kvlens_hit_tokens_total") >= loaded

    # Which instances can share: one info series naming what keys depend on.
    (info,) = _labels(after, "vllm:kvlens_info")
    assert info["chunk_size"] == "256" and info["tiers"] == "cpu" and info["role"] == "kv_both"
    assert re.fullmatch(r"[0-9a-f]{12}", info["key_fingerprint"]) and info["version"]
    # and whether a PD prefiller and decoder could pair (kvlens doctor): PD is off here
    assert (info["pd_role"], info["pd_init_ports"], info["tp_size"]) == ("", "", "1")
    assert int(info["block_size"]) > 0 and info["record_layout"].startswith("kvlens-record-1/")

    # How big should the tier be: a curve over the fixed factors, rising with the budget.
    def curve():
        s = srv.samples()
        return {f: sample(s, "vllm:kvlens_whatif_hit_ratio", tier="cpu", budget_factor=f) for f in FACTORS}

    def settled():
        # The curves are fed off the step loop and published with the engine's steps (at most
        # once a second): a short request keeps the engine stepping until the last references show.
        srv.complete(prompt_tokens(8, 1), max_tokens=1)
        points = curve()
        return None not in points.values() and points["1"] > 0.4 and points

    # 12 references: each prompt's first two chunks missed once, then hit once (the tier holds all)
    points = wait_until(settled, timeout=30, interval=1.1, what="what-if gauges")
    ratios = [points[f] for f in FACTORS]
    assert ratios == sorted(ratios) and all(0 <= r <= 1 for r in ratios)
    assert points["1"] == pytest.approx(0.5, abs=0.05)


def test_request_log_explains_each_request_without_its_tokens(serve_stack):
    srv = serve_stack.server
    p = prompt_tokens(700, 900)
    srv.complete(p, max_tokens=2, cache_salt="tenant-a")
    srv.reset_prefix_cache()
    other = srv.complete(p, max_tokens=2, cache_salt="tenant-b")["kv_transfer_params"]["kvlens"]
    # the response never tells tenant-b that tenant-a stored it; the operator's log does (below)
    assert other["miss_reason"] == "not_stored" and "miss_detail" not in other
    srv.reset_prefix_cache()
    warm = srv.complete(p, max_tokens=2, cache_salt="tenant-a")["kv_transfer_params"]["kvlens"]
    assert warm["loaded_tokens"] == {"cpu": 640}  # two chunks and a whole-block tail

    lines = wait_until(lambda: len(_log(serve_stack)) >= 3 and _log(serve_stack), what="request log lines")
    first, second, third = lines[-3:]
    assert (
        first["miss_reason"] == "not_stored" and first["kvlens_tokens"] == 0 and first["stored_chunks"] >= 2
    )
    assert second["miss_reason"] == "other_namespace" and second["miss_detail"] == {
        "differs_in": ["cache_salt"]
    }
    assert third["kvlens_tokens_by_tier"] == {"cpu": 640} and third["computed_tokens"] == 700 - 640
    assert third["load_ms"] > 0 and third["lookup_ms"] >= 0 and third["failed"] is False
    assert len({x["request_id"] for x in lines}) == len(lines)
    text = (serve_stack.tmp / "requests.jsonl").read_text()
    assert "tenant-" not in text and str(p[:8])[1:-1] not in text  # no salt, no token ids


def test_kvlens_stores_and_evictions_reach_vllms_kv_event_stream(serve_stack):
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    srv = serve_stack.server
    stream = serve_stack.events
    stream.drain(2.0)  # the publisher has connected before the first event
    stream.events.clear()  # what earlier tests of the module published
    p = prompt_tokens(600, 4242)
    srv.complete(p, max_tokens=2)
    events = stream.drain(3.0)
    stored = [e for e in events if isinstance(e, BlockStored)]
    ours = [e for e in stored if e.medium == "cpu"]
    vllms = [e for e in stored if e.medium != "cpu"]
    # KVLens's two chunks, by the same block hashes vLLM itself published for these tokens
    assert [len(e.block_hashes) for e in ours] == [2, 2]
    assert [list(e.token_ids) for e in ours] == [p[:256], p[256:512]]
    assert ours[1].parent_block_hash == ours[0].block_hashes[-1] and ours[0].parent_block_hash is None
    vllm_hashes = [h for e in vllms for h in e.block_hashes]
    assert [h for e in ours for h in e.block_hashes] == vllm_hashes[:4]

    srv.post("/reset_prefix_cache?reset_external=true")  # vLLM's cache and KVLens's
    srv.complete(prompt_tokens(8, 2), max_tokens=1)  # events go out with the next step
    removed = [e for e in stream.drain(3.0) if isinstance(e, BlockRemoved) and e.medium == "cpu"]
    assert {h for e in removed for h in e.block_hashes} >= {h for e in ours for h in e.block_hashes}
