"""Every panel of the KVLens Grafana dashboard as data: row, title, unit, PromQL.

Adding a panel is adding an entry to ``PANELS``. ``grafana.build`` turns the list into the
dashboard JSON; the tests run every expression here against a live Prometheus scraping a
real ``vllm serve`` and fail when one returns nothing. Write plain PromQL: ``with_selector``
adds the ``model_name`` / ``instance`` variables to every ``vllm:`` selector.

Conventions: ``rate(...[$__rate_interval])`` for time series, ``increase(...[$__range])``
for stats over the chosen range, ratios as ``num / (den > 0)`` (no traffic gives no series,
shown as "No traffic", instead of NaN).
"""

from __future__ import annotations

import re

from dashboard import palette
from dashboard.catalog import LEAK_GAUGES, MISS_REASONS

from .blend_panels import BLEND_PANELS
from .insight_panels import INSIGHT_PANELS
from .panel_types import (
    STAT,
    TABLE,
    TIMESERIES,
    TOKENS,
    TOKENS_PER_S,
    TREND,
    Panel,
    Target,
    increase_sum,
    quantile,
    rate_sum,
    ratio,
)
from .pd_panels import PD_PANELS
from .tenant_panels import TENANT_PANELS

ROWS = (
    "Overview",
    "Hits and misses",
    "Latency and throughput",
    "Tiers and leaks",
    "Failures",
    "Insights",
    "Tenants",
    "PD",
    "Blending",
)

__all__ = ["PANELS", "ROWS", "STAT", "TABLE", "TIMESERIES", "TREND", "Panel", "Target", "with_selector"]

# TraceQL searches the panels link to (the trace backend is a Grafana datasource variable).
TRACES_ALL = '{name=~"kvlens.*"}'
TRACES_FAILED_LOADS = '{name="kvlens.load" && status=error}'
TRACES_SLOW = '{name=~"kvlens.*"} | duration > 50ms'


def _store_sum(metric: str) -> str:
    """A tier gauge summed by tier, a store several engines share counted once: engines sharing a
    disk directory each report all of it under the directory's ``storage`` label, so per storage
    the max, not the sum; series without a storage (an engine's own memory) add up."""
    return (
        f'sum by (tier) (max by (tier, storage) ({metric}{{storage!=""}}))'
        f' or sum by (tier) ({metric}{{storage=""}})'
    )


def _leak_sum(by: str) -> str:
    """The count-valued leak gauges added up (pinned_bytes is bytes, shown on its own)."""
    return "\n+ ".join(f"sum by ({by}) (vllm:kvlens_{g})" for g in LEAK_GAUGES if g != "pinned_bytes")


def _at_most_one(share: str) -> str:
    """A decoder with a tier of its own may count a prefix both held and received."""
    return f"clamp_max(\n{share}\n, 1)"


def _with_pd(tiers: str, received: str) -> str:
    """``tiers + received``, where either may have no series: a decoder without a tier has no
    hit_tokens series, a KVLens older than PD no pd_loaded_tokens (each then counts as 0)."""
    return f"(\n({tiers} or {received} * 0)\n+ ({received} or {tiers} * 0)\n)"


# On a PD decoder, prompt tokens loaded from what a prefiller sent: KVLens supplied them.
_PD_LOADED = "vllm:kvlens_pd_loaded_tokens_total"
_PD_SOURCE = (
    f" {palette.PD_RECEIVED}: on a PD decoder, prompt tokens whose KV a prefiller computed and sent, "
    "loaded from the decoder's receive buffer (vllm:kvlens_pd_loaded_tokens_total; vLLM's source p2p)."
)

_IDLE = (
    "(sum by (instance) (vllm:num_requests_running) + sum by (instance) (vllm:num_requests_waiting)"
    " == bool 0)"
)

# The engine's own measure of a computed prompt token's cost (KVLens times whole prefill steps,
# connector/engine/prefill_cost.py). vLLM's per-request prefill times are no substitute: requests
# batched into one step each count that step's time, so their sum over the computed tokens
# overstates the cost by about the batch size.
_PREFILL_S_PER_TOKEN = "avg by (instance) (vllm:kvlens_prefill_seconds_per_token)"

PANELS: tuple[Panel, ...] = (
    # ---- Overview ------------------------------------------------------------------------------
    Panel(
        "Overview",
        "Prompt tokens KVLens held",
        "percentunit",
        (
            Target(
                ratio(
                    _with_pd(increase_sum("vllm:kvlens_hit_tokens_total"), increase_sum(_PD_LOADED)),
                    increase_sum("vllm:kvlens_lookup_tokens_total"),
                )
            ),
        ),
        "Share of looked-up prompt tokens KVLens had stored in a tier, or on a PD decoder received "
        "from a prefiller, over the time range." + _PD_SOURCE,
        kind=STAT,
        width=6,
        ratio=True,
    ),
    Panel(
        "Overview",
        "Prompt tokens loaded by KVLens",
        TOKENS,
        (Target(_with_pd(increase_sum("vllm:kvlens_load_tokens_total"), increase_sum(_PD_LOADED))),),
        "Prompt tokens not computed because KVLens loaded their KV from a tier, or on a PD decoder "
        "from what a prefiller sent, over the time range." + _PD_SOURCE,
        kind=STAT,
        width=6,
    ),
    Panel(
        "Overview",
        "Prefill time saved (estimated)",
        "s",
        (
            Target(
                f"{increase_sum('vllm:kvlens_prefill_seconds_saved_total')}\nor\nsum (\n"
                f"{increase_sum('vllm:kvlens_load_tokens_total', by='instance')}\n* on (instance)\n"
                f"{_PREFILL_S_PER_TOKEN}\n)"
            ),
        ),
        "The connector's estimate (vllm:kvlens_prefill_seconds_saved_total) over the range; where it "
        "exports none, tokens KVLens loaded times the engine's measured prefill seconds per token "
        "(vllm:kvlens_prefill_seconds_per_token), per instance. No value until the engine has measured "
        "a prefill. An estimate: per-token prefill cost grows with context length. Tokens received from "
        "a prefiller (PD) are not counted: their prefill ran on the prefiller.",
        kind=STAT,
        width=6,
    ),
    Panel(
        "Overview",
        "Requests with failed loads",
        "short",
        (Target(increase_sum("vllm:kvlens_failed_load_requests_total")),),
        "Requests with blocks KVLens could not load over the time range (recomputed or failed, by "
        "kv_load_failure_policy). Which ones: the failed-load event log or the trace link.",
        kind=STAT,
        width=6,
        alert_above=0,
        traces=TRACES_FAILED_LOADS,
    ),
    Panel(
        "Overview",
        "Hit rate",
        "percentunit",
        (
            Target(
                _at_most_one(
                    ratio(
                        _with_pd(rate_sum("vllm:kvlens_hit_tokens_total"), rate_sum(_PD_LOADED)),
                        rate_sum("vllm:kvlens_lookup_tokens_total"),
                    )
                ),
                "KVLens, tokens",
            ),
            Target(
                _at_most_one(
                    ratio(
                        _with_pd(
                            rate_sum("vllm:kvlens_hit_requests_total"),
                            rate_sum("vllm:kvlens_pd_loads_total", matchers='outcome="loaded"'),
                        ),
                        rate_sum("vllm:kvlens_lookup_requests_total"),
                    )
                ),
                "KVLens, requests",
            ),
            Target(
                ratio(rate_sum("vllm:prefix_cache_hits_total"), rate_sum("vllm:prefix_cache_queries_total")),
                "vLLM prefix cache, tokens",
            ),
        ),
        "KVLens: share of looked-up prompt tokens (and of requests) it held in a tier or, on a PD "
        "decoder, received from a prefiller. vLLM: its own prefix cache." + _PD_SOURCE,
        ratio=True,
    ),
    Panel(
        "Overview",
        "Where prompt tokens came from",
        TOKENS_PER_S,
        (
            Target(
                rate_sum("vllm:prompt_tokens_by_source_total", matchers='source="local_cache_hit"'),
                "vLLM prefix cache",
            ),
            Target(rate_sum("vllm:kvlens_load_tokens_total", by="tier"), "KVLens {{tier}}"),
            Target(rate_sum(_PD_LOADED), palette.PD_RECEIVED),
            Target(
                rate_sum("vllm:prompt_tokens_by_source_total", matchers='source="local_compute"'), "computed"
            ),
        ),
        "Prompt tokens per second served by vLLM's prefix cache, loaded by each KVLens tier, received "
        "from a prefiller (PD), or computed." + _PD_SOURCE,
        stack=True,
    ),
    Panel(
        "Overview",
        "KVLens hit rate by instance",
        "percentunit",
        (
            Target(
                _at_most_one(
                    ratio(
                        _with_pd(
                            rate_sum("vllm:kvlens_hit_tokens_total", by="instance"),
                            rate_sum(_PD_LOADED, by="instance"),
                        ),
                        rate_sum("vllm:kvlens_lookup_tokens_total", by="instance"),
                    )
                ),
                "{{instance}}",
            ),
        ),
        "Share of looked-up prompt tokens KVLens held in a tier or, on a PD decoder, received from a "
        "prefiller, per instance.",
        ratio=True,
    ),
    # ---- Hits and misses -----------------------------------------------------------------------
    Panel(
        "Hits and misses",
        "Cached prompt tokens by source (vLLM)",
        TOKENS_PER_S,
        (Target(rate_sum("vllm:prompt_tokens_cached_by_source_total", by="source"), "{{source}}"),),
        "vLLM's own attribution: device (its prefix cache), host (KVLens CPU tier), disk (KVLens disk tier), "
        "p2p (on a PD decoder: received from a prefiller).",
        stack=True,
    ),
    Panel(
        "Hits and misses",
        "Looked up, held, loaded, recomputed",
        TOKENS_PER_S,
        (
            Target(rate_sum("vllm:kvlens_lookup_tokens_total"), "looked up"),
            Target(rate_sum("vllm:kvlens_hit_tokens_total"), "held at lookup"),
            Target(rate_sum("vllm:kvlens_load_tokens_total"), "loaded"),
            Target(rate_sum("vllm:kvlens_recomputed_tokens_total"), "recomputed after a failed load"),
        ),
        "Reconciles lookups with loads: tokens held at lookup but not loaded were served by vLLM's own "
        "cache, skipped, or failed.",
    ),
    Panel(
        "Hits and misses",
        "KVLens hits by tier",
        TOKENS_PER_S,
        (Target(rate_sum("vllm:kvlens_hit_tokens_total", by="tier"), "{{tier}}"),),
        "Prompt tokens KVLens held at lookup, by the tier holding them.",
        stack=True,
    ),
    Panel(
        "Hits and misses",
        "Misses by reason",
        "reqps",
        (Target(rate_sum("vllm:kvlens_miss_requests_total", by="reason"), "{{reason}}"),),
        "Requests KVLens could not fully serve, by reason. "
        + "; ".join(f"{r}: {why}" for r, why in MISS_REASONS.items())
        + ".",
        stack=True,
    ),
    Panel(
        "Hits and misses",
        "Stores skipped by reason",
        "reqps",
        (Target(rate_sum("vllm:kvlens_save_skipped_requests_total", by="reason"), "{{reason}}"),),
        "Requests KVLens did not store (skip_save, priority_limit, consumer_role, ...).",
        stack=True,
    ),
    Panel(
        "Hits and misses",
        "Per-request hit ratio",
        "percentunit",
        (
            Target(quantile(0.5, "vllm:kvlens_request_hit_ratio_bucket"), "p50"),
            Target(quantile(0.9, "vllm:kvlens_request_hit_ratio_bucket"), "p90"),
        ),
        "Distribution of the share of each request's prompt that KVLens held.",
        ratio=True,
    ),
    # ---- Latency and throughput ----------------------------------------------------------------
    *(
        Panel(
            "Latency and throughput",
            f"{op.capitalize()} latency",
            "s",
            tuple(
                Target(
                    quantile(q, "vllm:kvlens_operation_seconds_bucket", matchers=f'operation="{op}"'),
                    f"p{round(q * 100)}",
                )
                for q in (0.5, 0.95, 0.99)
            ),
            f"Time per request spent in KVLens {op}s (histogram quantiles).",
            traces=TRACES_SLOW,
        )
        for op in ("lookup", "load", "store")
    ),
    Panel(
        "Latency and throughput",
        "Store throughput by tier",
        "Bps",
        (
            Target(
                ratio(
                    rate_sum("vllm:kvlens_store_bytes_total", by="tier"),
                    rate_sum(
                        "vllm:kvlens_transfer_seconds_total", by="tier", matchers='stage=~"gather|write"'
                    ),
                ),
                "{{tier}}",
            ),
        ),
        "Bytes each tier came to hold per second spent moving them there, timed where they move: the "
        "gather out of vLLM's KV cache into a host buffer (all of a CPU-tier store) plus, for disk and "
        "remote, the background write. All ranks' bytes over all ranks' seconds: one rank's speed.",
    ),
    Panel(
        "Latency and throughput",
        "Load throughput by tier",
        "Bps",
        (
            Target(
                ratio(
                    rate_sum("vllm:kvlens_transfer_bytes_total", by="tier", matchers='stage="copy"'),
                    rate_sum("vllm:kvlens_transfer_seconds_total", by="tier", matchers='stage=~"read|copy"'),
                ),
                "{{tier}}",
            ),
        ),
        "Bytes loaded into vLLM's KV cache from each tier per second spent moving them: the read from "
        "disk or remote (overlapping reads counted once; the CPU tier is read in place) plus the copy "
        "into the KV cache. All ranks' bytes over all ranks' seconds: one rank's speed.",
    ),
    Panel(
        "Latency and throughput",
        "Throughput by stage",
        "Bps",
        (
            Target(
                ratio(
                    rate_sum("vllm:kvlens_transfer_bytes_total", by="stage, tier"),
                    rate_sum("vllm:kvlens_transfer_seconds_total", by="stage, tier"),
                ),
                "{{stage}} {{tier}}",
            ),
        ),
        "Each stage on its own: gather (KV cache to host buffer), write (to disk or remote), read (from "
        "disk or remote), copy (into the KV cache). A gather feeding several tiers shows under each.",
    ),
    Panel(
        "Latency and throughput",
        "Data moved",
        "Bps",
        (
            Target(rate_sum("vllm:kvlens_load_bytes_total"), "loaded"),
            Target(rate_sum("vllm:kvlens_store_bytes_total", by="tier"), "stored {{tier}}"),
        ),
        "Bytes of KV per second of wall time loaded into vLLM and stored per tier.",
    ),
    Panel(
        "Latency and throughput",
        "Background write queue",
        "short",
        (Target("sum by (instance) (vllm:kvlens_pending_writes)", "{{instance}}"),),
        "Chunk writes and deletes queued for the background writers of the disk and remote tiers, "
        "on the busiest rank, as the workers last reported. Each tier holds at most "
        "extra_config.max_pending_write_bytes of queued writes (default 512 MiB); a store that does "
        "not fit is dropped and counted as a failed chunk (reason queue_full). An idle engine keeps "
        "stepping until this is 0.",
        width=8,
    ),
    Panel(
        "Latency and throughput",
        "Operations",
        "ops",
        (Target(rate_sum("vllm:kvlens_operation_seconds_count", by="operation"), "{{operation}}"),),
        "KVLens lookups, loads and stores per second.",
    ),
    Panel(
        "Latency and throughput",
        "Remote tier round trips (p95)",
        "s",
        (Target(quantile(0.95, "vllm:kvlens_remote_seconds_bucket", by="operation"), "{{operation}}"),),
        "Redis round trips by operation: exists (a lookup's one check), get (a load), put and delete "
        "(background). Empty without a remote tier.",
        needs_remote=True,
    ),
    Panel(
        "Latency and throughput",
        "Remote tier traffic and errors",
        "Bps",
        (
            Target(rate_sum("vllm:kvlens_remote_bytes_total", by="operation"), "{{operation}}"),
            Target(
                rate_sum("vllm:kvlens_remote_errors_total", by="operation, kind"),
                "errors {{operation}} {{kind}}",
            ),
        ),
        "Bytes per second to and from Redis, and failed round trips per second by kind (timeout, "
        "connection, oom, readonly, cluster, ...). Empty without a remote tier.",
        needs_remote=True,
    ),
    Panel(
        "Latency and throughput",
        "Time to first token and prefill (vLLM)",
        "s",
        (
            Target(quantile(0.95, "vllm:time_to_first_token_seconds_bucket"), "TTFT p95"),
            Target(
                ratio(
                    rate_sum("vllm:request_prefill_time_seconds_sum"),
                    rate_sum("vllm:request_prefill_time_seconds_count"),
                ),
                "mean prefill",
            ),
        ),
        "What KVLens hits should bring down.",
    ),
    Panel(
        "Latency and throughput",
        "Prefill seconds per computed token (engine)",
        "s",
        (Target(_PREFILL_S_PER_TOKEN, "{{instance}}"),),
        "What computing one prompt token costs this engine: the seconds of whole engine steps that "
        "computed prefill over the tokens they computed (vllm:kvlens_prefill_seconds_per_token, a "
        "decayed average over measured prefill steps). The 'prefill time saved' estimate multiplies it by "
        "the tokens KVLens loaded. Not vLLM's per-request prefill time over computed tokens: requests "
        "batched into one step each count that step's whole time, which overstates the cost by about "
        "the batch size. No value until the engine has measured a prefill step.",
    ),
    # ---- Tiers and leaks -----------------------------------------------------------------------
    Panel(
        "Tiers and leaks",
        "Tier fill",
        "percentunit",
        (
            Target(
                ratio(
                    f"({_store_sum('vllm:kvlens_tier_used_bytes')})",
                    f"({_store_sum('vllm:kvlens_tier_capacity_bytes')})",
                ),
                "{{tier}}",
            ),
        ),
        "Bytes held against each tier's budget.",
        width=6,
        ratio=True,
    ),
    Panel(
        "Tiers and leaks",
        "Tier used and capacity",
        "bytes",
        (
            Target(_store_sum("vllm:kvlens_tier_used_bytes"), "{{tier}} used"),
            Target(_store_sum("vllm:kvlens_tier_capacity_bytes"), "{{tier}} capacity"),
        ),
        "Bytes each tier holds and its budget (one rank's share), summed over instances; a disk "
        "directory several instances share counts once (each reports it whole).",
        width=6,
    ),
    Panel(
        "Tiers and leaks",
        "Evictions",
        "cps",
        (Target(rate_sum("vllm:kvlens_evictions_total", by="tier"), "{{tier}}"),),
        "Chunks evicted per second to make room, by tier. On a disk directory several instances "
        "share, each chunk counts once: by the instance whose delete removed the file.",
        width=6,
    ),
    Panel(
        "Tiers and leaks",
        "Chunks per tier",
        "short",
        (Target(_store_sum("vllm:kvlens_tier_chunks"), "{{tier}}"),),
        "Chunks each tier holds, summed over instances; a shared disk directory counts once.",
        width=6,
    ),
    Panel(
        "Tiers and leaks",
        "Leak gauges",
        "short",
        tuple(Target(f"sum (vllm:kvlens_{g})", g) for g in LEAK_GAUGES if g != "pinned_bytes"),
        "Internal sizes: they rise with load and must return to 0 when the engine is idle.",
        width=10,
    ),
    Panel(
        "Tiers and leaks",
        "Leaked state while idle",
        "short",
        (Target(f"(\n{_leak_sum('instance')}\n)\n* on (instance) {_IDLE}", "{{instance}}"),),
        "Sum of the leak gauges on instances with no request running or waiting (0 while busy). "
        "A value that stays above 0 is state KVLens did not release.",
        kind=STAT,
        width=6,
        height=8,
        alert_above=0,
    ),
    Panel(
        "Tiers and leaks",
        "Pinned bytes",
        "bytes",
        (Target("sum by (tier) (vllm:kvlens_pinned_bytes)", "{{tier}}"),),
        "Bytes pinned by pending loads (not evictable); must return to 0 when idle.",
    ),
    Panel(
        "Tiers and leaks",
        "Retained bytes",
        "bytes",
        (
            Target(
                "sum by (tier, retention) (vllm:kvlens_retention_bytes)",
                "{{tier}} class {{retention}}",
            ),
        ),
        "Bytes per tier and retention class (one rank's share): 0 normal, 1-3 the priority requests "
        "asked for (kvlens.retention_priority / kvlens.retain_for_s); retained chunks are evicted "
        "after every unretained one, within max_retained_share of the tier.",
    ),
    Panel(
        "Tiers and leaks",
        "Retained chunks evicted or demoted",
        "cps",
        (
            Target(rate_sum("vllm:kvlens_retained_evictions_total", by="tier"), "{{tier}} evicted"),
            Target(rate_sum("vllm:kvlens_retention_demotions_total", by="tier"), "{{tier}} demoted"),
            Target(rate_sum("vllm:kvlens_quota_evictions_total", by="tier"), "{{tier}} quota"),
        ),
        "Retained chunks evicted because nothing else was left, demoted beyond max_retained_share, "
        "and chunks a tenant at its tenant_quota_bytes replaced of its own.",
    ),
    # ---- Failures ------------------------------------------------------------------------------
    Panel(
        "Tiers and leaks",
        "Tier health",
        "short",
        (Target("min by (tier) (vllm:kvlens_tier_health)", "{{tier}}"),),
        "2 healthy, 1 failing (errors seen, still used), 0 skipped (nothing loaded or stored; probed after "
        "1, 2, 4 ... 60 s until a probe succeeds). The worst instance per tier.",
    ),
    Panel(
        "Tiers and leaks",
        "Suspect blocks",
        "short",
        (Target("sum by (instance) (vllm:kvlens_suspect_blocks)", "{{instance}}"),),
        "vLLM blocks whose load failed and that no step has rewritten yet: no chunk computed over them is "
        "stored. Returns to 0 once vLLM recomputes them.",
    ),
    Panel(
        "Failures",
        "Failed blocks by reason",
        "cps",
        (Target(rate_sum("vllm:kvlens_failed_blocks_total", by="reason"), "{{reason}}"),),
        "vLLM blocks per second KVLens failed to load. Each failure is also an annotation and a line "
        "in the failed-load event log.",
        traces=TRACES_FAILED_LOADS,
    ),
    Panel(
        "Failures",
        "Cost of failed loads",
        TOKENS_PER_S,
        (Target(rate_sum("vllm:kvlens_recomputed_tokens_total"), "tokens recomputed"),),
        "Prompt tokens vLLM recomputed because a KVLens load failed (kv_load_failure_policy=recompute).",
        traces=TRACES_FAILED_LOADS,
    ),
    Panel(
        "Failures",
        "Failed chunk reads and writes",
        "cps",
        (
            Target(
                rate_sum("vllm:kvlens_failed_chunks_total", by="operation, tier, reason"),
                "{{operation}} {{tier}} {{reason}}",
            ),
            Target(rate_sum("vllm:kvlens_failed_load_requests_total"), "requests with a failed load"),
        ),
        "Chunk operations that failed per second, by operation, tier and reason.",
        traces=TRACES_FAILED_LOADS,
    ),
    *INSIGHT_PANELS,
    *TENANT_PANELS,
    *PD_PANELS,
    *BLEND_PANELS,
)

# Failed loads as annotations on every time series. The counter without a reason label is
# used because it exists from start-up: increase() cannot see the first failure of a series
# that appears with it (failed_blocks{reason}).
FAILED_LOADS_ANNOTATION = Target(
    "sum by (instance) (increase(vllm:kvlens_failed_load_requests_total[$__interval])) > 0",
    "KVLens failed to load blocks for {{value}} requests on {{instance}}",
)

_SELECTOR = 'model_name=~"$model_name", instance=~"$instance"'
_METRIC = re.compile(r"(vllm:[A-Za-z0-9_:]+)(\{([^}]*)\})?")


def with_selector(expr: str, selector: str = _SELECTOR) -> str:
    """Adds the dashboard's variable matchers to every ``vllm:`` selector of ``expr``."""

    def add(m: re.Match[str]) -> str:
        inner = m.group(3)
        return f"{m.group(1)}{{{selector}{', ' + inner if inner else ''}}}"

    return _METRIC.sub(add, expr)
