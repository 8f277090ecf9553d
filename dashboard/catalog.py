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
    "pd_role",  # PD: "sender" (a prefiller), "receiver" (a decoder), "" (no PD)
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
    # PD (prefill/decode disaggregation): the engines' side and outcome, the proxy's phase and pair
    "side",
    "outcome",
    "phase",
    "prefiller",
    "decoder",
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
    "lookup_timeout": "the remote tier did not answer the lookup in time (remote_lookup_timeout_ms)",
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

# ---- PD (prefill/decode disaggregation), the names fixed in the PD design ----------------------
# The engines' PD series (on vLLM's /metrics), as Prometheus sample names.
PD_SENT_BYTES = "vllm:kvlens_pd_sent_bytes_total"
PD_RECEIVED_BYTES = "vllm:kvlens_pd_received_bytes_total"
PD_SEND_SECONDS = "vllm:kvlens_pd_send_seconds"  # histogram
PD_RECEIVE_SECONDS = "vllm:kvlens_pd_receive_seconds"  # histogram
PD_NOTIFY_WAIT_SECONDS = "vllm:kvlens_pd_notify_wait_seconds"  # histogram
PD_TRANSFERS = "vllm:kvlens_pd_transfers_total"  # {side="send"|"receive", outcome}
PD_FAILED_TRANSFERS = "vllm:kvlens_pd_failed_transfers_total"  # {side, reason}
PD_IN_FLIGHT = "vllm:kvlens_pd_transfers_in_flight"  # {side}
PD_BUFFER_USED = "vllm:kvlens_pd_buffer_used_bytes"
PD_BUFFER_CAPACITY = "vllm:kvlens_pd_buffer_capacity_bytes"
PD_BUFFER_ENTRIES = "vllm:kvlens_pd_buffer_entries"  # a leak gauge: back to 0 when idle
PD_LOADED_TOKENS = "vllm:kvlens_pd_loaded_tokens_total"  # prompt tokens a decoder loaded from its buffer
PD_LOADS = "vllm:kvlens_pd_loads_total"  # {outcome}: decoder requests by what PD gave them
_PD_HISTOGRAMS = (PD_SEND_SECONDS, PD_RECEIVE_SECONDS, PD_NOTIFY_WAIT_SECONDS)
PD_SAMPLE_NAMES = frozenset(
    {
        PD_SENT_BYTES,
        PD_RECEIVED_BYTES,
        PD_TRANSFERS,
        PD_FAILED_TRANSFERS,
        PD_IN_FLIGHT,
        PD_BUFFER_USED,
        PD_BUFFER_CAPACITY,
        PD_BUFFER_ENTRIES,
        PD_LOADED_TOKENS,
        PD_LOADS,
        *(h + s for h in _PD_HISTOGRAMS for s in ("_sum", "_count")),
    }
)
PD_HISTOGRAM_BUCKETS = frozenset(h + "_bucket" for h in _PD_HISTOGRAMS)

# kvlens_info's pd_role of each side of a PD pair.
PD_SENDER, PD_RECEIVER = "sender", "receiver"

# The PD proxy's own /metrics (``kvlens pd-proxy``).
PROXY_PREFIX = "kvlens_pd_proxy_"
PROXY_REQUESTS = "kvlens_pd_proxy_requests_total"  # {outcome}
PROXY_PHASE = "kvlens_pd_proxy_phase_seconds"  # histogram {phase, prefiller, decoder}
PROXY_WAIT_TIMEOUTS = "kvlens_pd_proxy_wait_timeouts_total"  # {prefiller, decoder}
PROXY_IN_FLIGHT = "kvlens_pd_proxy_in_flight"
PROXY_SAMPLE_NAMES = frozenset(
    {
        PROXY_REQUESTS,
        PROXY_PHASE + "_sum",
        PROXY_PHASE + "_count",
        PROXY_WAIT_TIMEOUTS,
        PROXY_IN_FLIGHT,
    }
)
# The proxy's phases of a request's time to first token (label values of ``phase``), in order;
# ttft is their whole.
PD_PHASES = ("prefill", "transfer_wait", "decode_first_token")
PD_TTFT = "ttft"
# Why a PD transfer was refused or failed (vllm:kvlens_pd_failed_transfers_total{reason}); a
# handshake mismatch is "mismatch:<fields>", shown as "mismatch"; "expired": unclaimed entries.
PD_REASONS = (
    "buffer_full",
    "too_large",
    "mismatch",
    "unreachable",
    "timeout",
    "peer_closed",
    "checksum",
    "shutdown",
    "expired",
)


def pd_known() -> frozenset[str]:
    """The PD sample names telemetry.metrics defines (none before PD's metrics land)."""
    return frozenset(n for n in kvlens_sample_names() if n.startswith("vllm:kvlens_pd_"))


# What the Streamlit app keeps from each /metrics scrape (histograms other than the
# operation latencies are not drawn, so their buckets are not kept).
APP_SAMPLE_NAMES = frozenset(
    (kvlens_sample_names() - {kvlens("request_hit_ratio", "_bucket")} - PD_HISTOGRAM_BUCKETS)
    | (VLLM_SAMPLE_NAMES - {VLLM_TTFT_BUCKET})
    | PD_SAMPLE_NAMES
)
