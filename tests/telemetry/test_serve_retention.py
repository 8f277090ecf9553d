"""Real ``vllm serve`` (CPU) with a CPU tier of eight chunks and retention allowed for requests
without salt or tag (``retention_allowed: [default]``), otherwise at default settings: a
system prompt sent once with a retention priority survives a flood of one-off prompts that
evicts an unretained prefix stored before it. Checked through the responses'
``kv_transfer_params`` and vLLM's own count of prompt tokens cached by source, and the
retained bytes on /metrics."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from .serve import kv_transfer_config, prompt_tokens, sample, sum_samples, wait_until

pytestmark = pytest.mark.integration

CHUNK = 256
# The tiny model in bfloat16: 2 (K, V) x 4 layers x 2 heads x 64 x 2 bytes = 2 KiB a token.
CHUNK_BYTES = CHUNK * 2048
KV_CONFIG = kv_transfer_config(
    max_local_cpu_size=8 * CHUNK_BYTES / 1024**3, extra_config={"retention_allowed": ["default"]}
)
RETAIN = {"kvlens.retention_priority": 2, "kvlens.retain_for_s": 600}
CACHED = "vllm:prompt_tokens_cached_by_source_total"
WORKER_PROCESS = False  # retention is the scheduler half's: the worker runs in the engine core


def ask(srv, prompt: list[int], **params) -> dict:
    body = {"kv_transfer_params": params} if params else {}
    return srv.complete(prompt, **body)["kv_transfer_params"]


@pytest.fixture(scope="module")
def flooded(serve_stack):
    """Two 512-token prefixes, the second retained, then twelve one-off prompts (24 chunks for
    a tier of 8); then both prefixes asked again with new suffixes (suffixes shorter than a
    vLLM block: only whole chunks are stored)."""
    srv = serve_stack.server
    system, other = prompt_tokens(2 * CHUNK, 1), prompt_tokens(2 * CHUNK, 2)
    ask(srv, other + prompt_tokens(100, 3))
    stored = ask(srv, system + prompt_tokens(100, 4), **RETAIN)
    for seed in range(12):
        ask(srv, prompt_tokens(2 * CHUNK + 8, 100 + seed))
    srv.reset_prefix_cache()  # vLLM's own cache: what follows can only come from KVLens
    before = srv.samples()
    retained = ask(srv, system + prompt_tokens(100, 5))
    unretained = ask(srv, other + prompt_tokens(100, 6))
    return SimpleNamespace(srv=srv, stored=stored, retained=retained, unretained=unretained, before=before)


def test_the_retained_system_prompt_survives_the_flood(flooded):
    assert flooded.stored["kvlens"]["save_skip_reason"] is None
    assert flooded.retained["num_lmcache_cached_tokens"] == 2 * CHUNK
    assert flooded.retained["kvlens"]["loaded_tokens"] == {"cpu": 2 * CHUNK}


def test_the_unretained_prefix_stored_before_it_was_evicted(flooded):
    assert flooded.unretained["num_lmcache_cached_tokens"] == 0
    assert flooded.unretained["kvlens"]["miss_reason"] == "evicted"


def test_vllm_counts_the_retained_prefix_as_loaded_from_host_memory(flooded):
    srv, before = flooded.srv, flooded.before

    def cached_from_cpu():
        d = sum_samples(srv.samples(), CACHED, source="host") - sum_samples(before, CACHED, source="host")
        return d if d == 2 * CHUNK else None

    wait_until(cached_from_cpu, what=f"{CACHED}{{source=host}} += {2 * CHUNK}")


def test_metrics_show_the_retained_bytes_and_no_retained_eviction(flooded):
    srv = flooded.srv

    def retained_bytes():
        s = srv.samples()
        return (
            s
            if sample(s, "vllm:kvlens_retention_bytes", tier="cpu", retention="2") == 2 * CHUNK_BYTES
            else None
        )

    s = wait_until(retained_bytes, what="kvlens_retention_bytes{tier=cpu,retention=2} == 2 chunks")
    for retention in ("1", "3"):  # a closed label set: every class exists
        assert sample(s, "vllm:kvlens_retention_bytes", tier="cpu", retention=retention) == 0
    normal = sample(s, "vllm:kvlens_retention_bytes", tier="cpu", retention="0")
    assert normal + 2 * CHUNK_BYTES == sample(s, "vllm:kvlens_tier_used_bytes", tier="cpu", storage="")
    assert sample(s, "vllm:kvlens_evictions_total", tier="cpu") >= 12
    assert sample(s, "vllm:kvlens_retained_evictions_total", tier="cpu") == 0
    assert sample(s, "vllm:kvlens_retention_demotions_total", tier="cpu") == 0
