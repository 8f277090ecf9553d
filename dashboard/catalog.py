"""The metric names the dashboards read, in one place.

KVLens names come from ``telemetry.metrics`` (a typo here fails at import); vLLM's own are the
series vLLM 0.32 puts on ``/metrics`` next to them. Prometheus sample names: counters end in
``_total``, histograms come as ``_bucket``/``_sum``/``_count``.
"""

from __future__ import annotations

from telemetry.metrics import COUNTER, HISTOGRAM, METRICS

# The labels of vllm:kvlens_info: what an instance is and where its shared tiers live.
INFO_LABELS = (
    "version",
    "chunk_size",
    "key_fingerprint",
    "tiers",
    "role",
    "storage",
    "model_identity",
    "quantization",
    "kv_cache_dtype",
)

# Labels a dashboard groups by; every other label (job, ...) is summed away.
LABELS = (
    "model_name",
    "engine",
    "tier",
    "operation",
    "reason",
    "kind",
    "source",
    "le",
    "budget_factor",
    "stage",
    "tenant",
    "retention",
    *INFO_LABELS,
)

KNOWN = METRICS

# The budget factors of vllm:kvlens_whatif_hit_ratio (label values, exactly).
BUDGET_FACTORS = ("0.125", "0.25", "0.5", "1", "2", "4", "8", "16")

# Every reason of vllm:kvlens_miss_requests_total{reason} and what it tells an operator.
MISS_REASONS = {
    "not_stored": "never stored (new traffic, a config or model change)",
    "evicted": "stored, then evicted (tier too small)",
    "partial_chunk": "only an unfull chunk remains",
    "vllm_hit": "vLLM's own prefix cache already held it",
    "below_min_retrieve": "fewer tokens than min_retrieve_tokens",
    "tier_unhealthy": "in a tier marked unhealthy",
    "producer_role": "a kv_producer never loads",
    "prompt_logprobs": "prompt logprobs requested: vLLM skips cached KV",
    "unsupported_input": "multimodal, prompt embeddings or DP padding",
    "invalid_params": "malformed lmcache.* request parameters",
    "other_namespace": "stored, under another namespace (model, dtype, layout, cache_salt or tags differ)",
    "load_failed": "the load failed; vLLM recomputed",
    "slower_than_recompute": "stored, but its tier loads slower than prefill computes it",
}


def kvlens(key: str, suffix: str = "") -> str:
    """The sample name of a KVLens metric: counters get ``_total``, histograms ``suffix``."""
    metric = KNOWN[key]
    if metric.kind == COUNTER:
        return metric.name + "_total"
    if metric.kind == HISTOGRAM:
        if suffix not in ("_bucket", "_sum", "_count"):
            raise ValueError(f"{metric.name} is a histogram: name a _bucket, _sum or _count sample")
        return metric.name + suffix
    return metric.name


def kvlens_sample_names() -> frozenset[str]:
    """Every sample name KVLens can put on /metrics."""
    out = set()
    for key, metric in KNOWN.items():
        if metric.kind == HISTOGRAM:
            out.update(kvlens(key, s) for s in ("_bucket", "_sum", "_count"))
        else:
            out.add(kvlens(key))
    return frozenset(out)


# Internal sizes that must return to zero when the engine is idle (the README's "Leaks" row).
# pending_writes is a queue depth, not one of them: an idle engine steps until it is 0.
LEAK_GAUGES = (
    "request_trackers",
    "load_specs",
    "pending_saves",
    "unfinished_requests",
    "invalid_block_ids",
    "pinned_requests",
    "pinned_chunks",
    "pinned_bytes",
    "telemetry_open_requests",
)

# vLLM's own series the dashboards use.
VLLM_PROMPT_TOKENS = "vllm:prompt_tokens_total"
# source: local_compute / local_cache_hit / external_kv_transfer
VLLM_PROMPT_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
VLLM_CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"  # device / host / disk / ...
VLLM_PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
VLLM_PREFIX_HITS = "vllm:prefix_cache_hits_total"
VLLM_EXTERNAL_QUERIES = "vllm:external_prefix_cache_queries_total"
VLLM_EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
VLLM_PREFILL_SECONDS_SUM = "vllm:request_prefill_time_seconds_sum"
VLLM_PREFILL_SECONDS_COUNT = "vllm:request_prefill_time_seconds_count"
VLLM_TTFT_BUCKET = "vllm:time_to_first_token_seconds_bucket"
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"

VLLM_SAMPLE_NAMES = frozenset(
    {
        VLLM_PROMPT_TOKENS,
        VLLM_PROMPT_BY_SOURCE,
        VLLM_CACHED_BY_SOURCE,
        VLLM_PREFIX_QUERIES,
        VLLM_PREFIX_HITS,
        VLLM_EXTERNAL_QUERIES,
        VLLM_EXTERNAL_HITS,
        VLLM_PREFILL_SECONDS_SUM,
        VLLM_PREFILL_SECONDS_COUNT,
        VLLM_TTFT_BUCKET,
        VLLM_RUNNING,
        VLLM_WAITING,
    }
)

# What the Streamlit app keeps from each /metrics scrape (histograms other than the
# operation latencies are not drawn, so their buckets are not kept).
APP_SAMPLE_NAMES = frozenset(
    (kvlens_sample_names() - {kvlens("request_hit_ratio", "_bucket")})
    | (VLLM_SAMPLE_NAMES - {VLLM_TTFT_BUCKET})
)
