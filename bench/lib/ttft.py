"""Time to first token of one prompt, as ``ttft_peers.py`` and ``prompt_scaling.py`` measure it.

In one server: the prompt's first request (cold: a connector stores its KV), then pairs of the
floor (vLLM's own prefix-cache hit) and, after ``POST /reset_prefix_cache``, the connector's hit
(or a recompute without one). Each hit is divided by the floor measured just before it, so the
ratio does not depend on how busy the machine was that minute. TTFT is the wall time of a
one-token greedy completion over HTTP (REFERENCE.md section 9).
"""

from __future__ import annotations

import random

from .client import Client
from .report import Check, Figure, Record, Target
from .served import LiveMode

HIT_TARGET = 1.01
STORE_TARGET = 1.01
SKIP_SAVE = {"lmcache.skip_save": True}
STORE_TIMER = "vllm:kvlens_operation_seconds_sum"
TTFT_PANEL = "TTFT per mode (median, min..max)"

COLD = Figure("cold_s", "cold s", panel=TTFT_PANEL, log=True)
FLOOR = Figure("floor_s", "floor s", panel=TTFT_PANEL, log=True)
HIT = Figure("hit_s", "hit s", panel=TTFT_PANEL, log=True)
PAIR_RATIO = Figure("pair_ratio", "hit/floor (pairs)")
COLD_OVER_HIT = Figure("cold_over_hit", "cold/hit", "{:.1f}", plot=False)
HIT_TOKENS = Figure("hit_cached_tokens", "hit tokens", "{:.0f}", plot=False)
FLOOR_TOKENS = Figure("floor_cached_tokens", "floor tokens", "{:.0f}", plot=False)
LOAD_MS = Figure("kvlens_load_ms", "load ms", "{:.1f}", plot=False)
FIGURES = (COLD, FLOOR, HIT, PAIR_RATIO, COLD_OVER_HIT, HIT_TOKENS, FLOOR_TOKENS, LOAD_MS)
HIT_CHECKS = (
    Check("first_token_matches", "a hit produced another first token than vLLM's own hit on the same prompt"),
    Check(
        "hit_served_all", "its hits served fewer cached tokens than vLLM's own hit: the rest was recomputed"
    ),
)
LEGEND = (
    "hit/floor: each connector hit over the vLLM prefix hit measured just before it (median, min..max).",
    "cold/hit: the prompt's cold request over each connector hit (what the connector saves).",
    "hit tokens / floor tokens: cached tokens of a connector hit / of vLLM's own hit (the rest is "
    "recomputed).",
    "no connector: the 'hit' after the flush is a recompute. load ms: KVLens's own load time of the hit.",
)
HIT_GOAL = Target(f"KVLens hit <= {HIT_TARGET} x floor", "pair_ratio", HIT_TARGET, mode_prefix="kvlens")


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab - 1) for _ in range(n)]


def warm_up(client: Client, tokens: list[int]) -> None:
    """Every path a measurement takes, once, unmeasured: cold (and store), prefix hit, flush,
    connector hit."""
    client.complete(tokens)
    client.complete(tokens)
    client.reset_prefix_cache()
    client.complete(tokens)


def measure_prompt(lm: LiveMode, tokens: list[int], pairs: int) -> Record:
    """Cold, then ``pairs`` x (floor, flush, hit) on one prompt in one server."""
    c, connector = lm.client, lm.mode.connector is not None
    cold = c.complete(tokens)
    rec: Record = {"cold_s": cold.seconds, "cold_cached_tokens": cold.cached_tokens}
    for _ in range(pairs):
        floor = c.complete(tokens)
        c.reset_prefix_cache()
        hit = c.complete(tokens)
        add = {"floor_s": floor.seconds, "hit_s": hit.seconds}
        add |= {"floor_cached_tokens": floor.cached_tokens, "hit_cached_tokens": hit.cached_tokens}
        # A hit computes the prompt's tail on a cached prefix, as vLLM's own hit does: it must give
        # the floor's token. The cold run computed every token in one pass, and in bf16 that can
        # break a near tie the other way (seen at 2,000 tokens with vLLM's own hit too).
        reference = floor if hit.cached_tokens else cold
        add["first_token_matches"] = hit.token_ids == reference.token_ids
        if connector:
            add |= {"pair_ratio": hit.seconds / floor.seconds, "cold_over_hit": cold.seconds / hit.seconds}
            add["hit_served_all"] = hit.cached_tokens >= floor.cached_tokens
        usage = (hit.kv_transfer_params or {}).get("kvlens") or {}
        if "load_ms" in usage:
            add["kvlens_load_ms"] = usage["load_ms"]
        for key, value in add.items():
            rec.setdefault(key, []).append(value)
    return rec


def measure_store_pair(lm: LiveMode, stored: list[int], skipped: list[int], store_first: bool) -> Record:
    """Two cold requests on fresh prompts, one stored as usual and one with ``skip_save``, and
    KVLens's own store timer over both."""
    c = lm.client
    before = c.metric_sum(STORE_TIMER, operation="store")
    seconds, reason = {}, None
    for which in ("store", "skip") if store_first else ("skip", "store"):
        done = c.complete(
            stored if which == "store" else skipped, kv_params=SKIP_SAVE if which == "skip" else None
        )
        seconds[which] = done.seconds
        if which == "skip":
            reason = ((done.kv_transfer_params or {}).get("kvlens") or {}).get("save_skip_reason")
    timer = c.metric_sum(STORE_TIMER, operation="store") - before
    return {
        "store_s": seconds["store"],
        "skip_s": seconds["skip"],
        "store_over_skip": seconds["store"] / seconds["skip"],
        "store_timer_ms": timer * 1000,
        "store_timer_share_of_cold": timer / seconds["skip"],
        "skip_save_honoured": reason == "skip_save",
        "skip_reason": reason,
    }
