"""Every KVLens metric in one place, the plain-dict stats payload, and its Prometheus side.

Hot paths only add numbers to a ``StatsBuffer`` (plain dicts). vLLM carries the buffer's
payload from the workers and the scheduler to the API server (``get_kv_connector_stats``),
where ``PromRecorder`` turns it into ``vllm:kvlens_*`` series on vLLM's own ``/metrics``.

Payload layout (string keys only, so it survives pickle and msgpack)::

    {"counters": {"load_tokens|cpu": 512, ...},      # summed when merged
     "gauges": {"request_trackers": 0, ...},          # the latest value wins
     "histograms": {"operation_seconds|load": [0.002, ...]}}   # observations, concatenated

A wire key is the metric's short key, then its extra label values, joined by ``|``. A gauge
that each tensor-parallel rank reports for itself ends in ``#<rank>``; its series is the sum
over ranks.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from connector.engine.snapshots import KnownLabels

logger = logging.getLogger("vllm.kvlens")

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
SEP = "|"
RANK_SEP = "#"

# Latency buckets from 10 us to ~20 s: lookups are microseconds, loads and stores milliseconds.
SECONDS_BUCKETS = (
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
)
_SHARED_TOTALS = (
    "{}; storage names a directory several engines share (each reports it whole: take the max per "
    "storage), empty for this engine's own."
)
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


# Closed sets of label values telemetry itself defines; the connector's come in ``KnownLabels``.
OPERATIONS = ("lookup", "load", "store")
CHUNK_OPERATIONS = ("load", "store")
_OWN_DOMAINS = {"operations": OPERATIONS, "chunk_operations": CHUNK_OPERATIONS}


@dataclass(frozen=True, slots=True)
class Metric:
    key: str  # short key used in the stats payload
    kind: str  # COUNTER, GAUGE or HISTOGRAM
    doc: str
    labels: tuple[str, ...] = ()  # bounded labels beyond model_name and engine
    buckets: tuple[float, ...] | None = None
    # Per label, the closed set of its values (a ``KnownLabels`` field or one of
    # ``_OWN_DOMAINS``): every combination exists at zero from start-up. None: the series
    # appear with their first value (estimates that are unknown until measured, open sets).
    domains: tuple[str, ...] | None = ()

    @property
    def name(self) -> str:
        return "vllm:kvlens_" + self.key

    def label_domains(self) -> tuple[str, ...] | None:
        if self.domains is None:
            return None
        if self.domains:
            return self.domains
        return tuple("tiers" if label == "tier" else "" for label in self.labels)


_DEFINITIONS = (
    # lookups (scheduler)
    Metric("lookup_requests", COUNTER, "Requests whose prefix KVLens looked up (final lookups)."),
    Metric("lookup_tokens", COUNTER, "Prompt tokens of the requests looked up."),
    Metric("vllm_hit_tokens", COUNTER, "Prompt tokens vLLM's own prefix cache already had at lookup."),
    Metric("hit_tokens", COUNTER, "Prompt tokens KVLens held at lookup, by tier.", ("tier",)),
    Metric("hit_requests", COUNTER, "Looked-up requests of which KVLens held at least one chunk."),
    Metric(
        "miss_requests",
        COUNTER,
        "Looked-up requests KVLens could not fully serve, by reason.",
        ("reason",),
        domains=("miss_reasons",),
    ),
    Metric(
        "save_skipped_requests",
        COUNTER,
        "Requests KVLens does not store, by reason.",
        ("reason",),
        domains=("save_skip_reasons",),
    ),
    Metric(
        "ignored_request_params",
        COUNTER,
        "lmcache.* request parameters KVLens does not know: ignored, the request served as usual.",
    ),
    # the operator's retention rules (retention_allowed, retention_max_*): asks not granted
    Metric(
        "retention_refused_requests",
        COUNTER,
        "Requests that asked for retention and got less, by reason: not_allowed (their tenant is not "
        "in retention_allowed: none) or capped (to retention_max_priority / retention_max_seconds).",
        ("reason",),
        domains=("retention_refusals",),
    ),
    Metric(
        "request_hit_ratio",
        HISTOGRAM,
        "Per request: fraction of the prompt KVLens held.",
        buckets=RATIO_BUCKETS,
    ),
    # loads (scheduler, from the workers' merged reports)
    Metric("load_requests", COUNTER, "Requests for which KVLens loaded KV into vLLM."),
    Metric("load_tokens", COUNTER, "Tokens whose KV KVLens loaded into vLLM, by tier.", ("tier",)),
    Metric("load_bytes", COUNTER, "Bytes of KV KVLens loaded into vLLM (all ranks)."),
    Metric("failed_load_requests", COUNTER, "Requests whose load failed, in part or whole."),
    Metric(
        "rank_disagreements",
        COUNTER,
        "Loads whose tensor-parallel ranks listed different chunks (logged; never raised).",
    ),
    Metric(
        "failed_blocks",
        COUNTER,
        "vLLM blocks KVLens failed to load, by reason.",
        ("reason",),
        domains=("failure_reasons",),
    ),
    Metric(
        "recomputed_tokens",
        COUNTER,
        "Tokens vLLM recomputed because a KVLens load failed (kv_load_failure_policy=recompute).",
    ),
    Metric(
        "failed_chunks",
        COUNTER,
        "Chunk reads or writes that failed, by operation, tier and reason.",
        ("operation", "tier", "reason"),
        domains=("chunk_operations", "tiers", "failure_reasons"),
    ),
    # stores (workers, through the scheduler): counted once the tier holds them
    Metric(
        "store_chunks",
        COUNTER,
        "Chunks written to each tier, counted once the tier holds them (CPU at once, disk and remote "
        "when the background write returned); failed or dropped writes are failed_chunks instead.",
        ("tier",),
    ),
    Metric("store_tokens", COUNTER, "Tokens of the chunks in store_chunks, by tier.", ("tier",)),
    Metric("store_bytes", COUNTER, "Bytes of the chunks in store_chunks, by tier (all ranks).", ("tier",)),
    # where the bytes move, per stage and tier: throughput = transfer_bytes / transfer_seconds
    Metric(
        "transfer_bytes",
        COUNTER,
        "Bytes moved, by stage (gather: KV cache to a host buffer; write: to disk/remote; read: from "
        "disk/remote; copy: into the KV cache) and tier. A gather feeding several tiers counts under "
        "each. All ranks.",
        ("stage", "tier"),
        domains=("transfer_stages", "tiers"),
    ),
    Metric(
        "transfer_seconds",
        COUNTER,
        "Time the bytes of transfer_bytes took to move, by stage and tier (rank-seconds; a tier's "
        "overlapping reads count once).",
        ("stage", "tier"),
        domains=("transfer_stages", "tiers"),
    ),
    # both
    Metric(
        "operation_seconds",
        HISTOGRAM,
        "Time per request and operation (lookup, load, store).",
        ("operation",),
        SECONDS_BUCKETS,
        ("operations",),
    ),
    Metric(
        "evictions",
        COUNTER,
        "Chunks evicted to make room, by tier (disk: counted by the engine whose delete removed the file).",
        ("tier",),
        domains=("indexed_tiers",),
    ),
    # the remote tier (Redis / Valkey), per round trip
    Metric(
        "remote_seconds",
        HISTOGRAM,
        "Remote tier round trips by operation (exists: a lookup; get: a load; put/delete: background).",
        ("operation",),
        SECONDS_BUCKETS,
        ("remote_operations",),
    ),
    Metric(
        "remote_bytes",
        COUNTER,
        "Bytes moved to or from the remote tier, by operation.",
        ("operation",),
        domains=("remote_operations",),
    ),
    Metric(
        "remote_errors",
        COUNTER,
        "Remote tier round trips that failed, by operation and kind (timeout, connection, oom, ...).",
        ("operation", "kind"),
        domains=("remote_operations", "remote_error_kinds"),
    ),
    # gauges: internal sizes, so that leaks show
    Metric("request_trackers", GAUGE, "Requests the scheduler half tracks."),
    Metric("load_specs", GAUGE, "Lookup results waiting for vLLM to schedule their request."),
    Metric("pending_saves", GAUGE, "Requests still in prefill whose KV KVLens will store."),
    Metric("unfinished_requests", GAUGE, "Requests KVLens saw allocated and not yet finished."),
    Metric("invalid_block_ids", GAUGE, "Failed block ids not yet handed to vLLM (all ranks)."),
    Metric(
        "pending_writes",
        GAUGE,
        "Chunk writes and deletes queued for the disk and remote tiers' background writers (the busiest "
        "rank, as last reported): an idle engine keeps stepping until it is 0.",
    ),
    Metric(
        "reusable_buffer_bytes",
        GAUGE,
        "Bytes of buffers the CPU tier dropped, kept for the next stores to gather into (all ranks).",
    ),
    Metric("suspect_blocks", GAUGE, "vLLM blocks whose load failed and that no step has rewritten yet."),
    Metric("pinned_requests", GAUGE, "Requests holding pins on cached chunks."),
    Metric(
        "pinned_chunks",
        GAUGE,
        "Chunks pinned (not evictable) by pending loads, by tier.",
        ("tier",),
        domains=("indexed_tiers",),
    ),
    Metric(
        "pinned_bytes",
        GAUGE,
        "Bytes pinned by pending loads, by tier.",
        ("tier",),
        domains=("indexed_tiers",),
    ),
    # storage: a store several engines share and each reports whole (a disk directory:
    # disk:<hash of host and path>, as in kvlens_info), "" for this engine's own: total = the
    # sum over storage="" plus, per storage, the max (not the sum) over engines. They appear
    # with the first stats (the storage label is known only then).
    Metric(
        "tier_chunks",
        GAUGE,
        _SHARED_TOTALS.format("Chunks each tier holds"),
        ("tier", "storage"),
        domains=None,
    ),
    Metric(
        "tier_used_bytes",
        GAUGE,
        _SHARED_TOTALS.format("Bytes each tier holds (one rank's share)"),
        ("tier", "storage"),
        domains=None,
    ),
    Metric(
        "tier_capacity_bytes",
        GAUGE,
        _SHARED_TOTALS.format("Byte budget of each tier (one rank's share)"),
        ("tier", "storage"),
        domains=None,
    ),
    Metric(
        "tier_stored_bytes",
        GAUGE,
        "Bytes the workers' CPU tiers actually hold (all ranks); equals tier_used_bytes x ranks.",
        ("tier",),
        domains=None,  # the CPU tier's only: appears with the workers' first report
    ),
    Metric("tier_health", GAUGE, "Tier health: 2 healthy, 1 failing (still used), 0 skipped.", ("tier",)),
    Metric("telemetry_open_requests", GAUGE, "Requests KVLens telemetry keeps state for."),
    # insight: which instances can share, what a bigger tier would hit, what the cache saved
    Metric(
        "info",
        GAUGE,
        "1, labelled with what decides whether instances can share KV (key fingerprint, chunk size, store).",
        (
            "version",
            "chunk_size",
            "key_fingerprint",
            "tiers",
            "role",
            "storage",
            "model_identity",
            "quantization",
            "kv_cache_dtype",
            # PD: what decides whether a prefiller and a decoder can pair (kvlens doctor)
            "pd_role",
            "tp_size",
            "block_size",
            "record_layout",
            "pd_host",
            "pd_init_ports",
            "pd_alloc_ports",
            "pd_buffer_size",
            "pd_proxy",
            "pd_auth",
            "pd_tls",
        ),
        domains=None,
    ),
    Metric(
        "whatif_hit_ratio",
        GAUGE,
        "Estimated token hit ratio of the tier at budget_factor times its configured size (sampled LRU).",
        ("tier", "budget_factor"),
        domains=None,  # no curve before the tier's first reference
    ),
    Metric(
        "prefill_seconds_saved",
        COUNTER,
        "Estimated prefill compute seconds saved: tokens KVLens loaded x measured prefill cost per token.",
        ("tier",),
        domains=None,  # unknown (no series) until the engine has measured a prefill cost
    ),
    Metric(
        "prefill_seconds_per_token",
        GAUGE,
        "This engine's measured prefill cost per token (cold prefill steps, decayed average).",
        domains=None,  # unknown (no series) until measured
    ),
    # retention (kvlens.retention_priority / kvlens.retain_for_s) and tenant quotas, CPU and disk
    Metric(
        "retention_bytes",
        GAUGE,
        "Bytes each tier holds by retention class (0 normal, 1-3 the retention priority; one rank's share).",
        ("tier", "retention"),
        domains=("indexed_tiers", "retention_classes"),
    ),
    Metric(
        "retained_evictions",
        COUNTER,
        "Retained chunks evicted because nothing unretained and unpinned was left, by tier.",
        ("tier",),
        domains=("indexed_tiers",),
    ),
    Metric(
        "retention_demotions",
        COUNTER,
        "Retained chunks made normal because retained chunks exceeded max_retained_share, by tier.",
        ("tier",),
        domains=("indexed_tiers",),
    ),
    Metric(
        "quota_evictions",
        COUNTER,
        "Chunks a tenant at its tenant_quota_bytes evicted of its own to store new ones, by tier.",
        ("tier",),
        domains=("indexed_tiers",),
    ),
    Metric(
        "quota_refusals",
        COUNTER,
        "Chunks not stored because their tenant was at its quota and its own chunks could not make room.",
        ("tier",),
        domains=("indexed_tiers",),
    ),
)
# the disk tier's scrub (connector/scheduler/disk_scrub.py): records verified in the background
_DEFINITIONS += (
    Metric(
        "disk_scrubbed_records",
        COUNTER,
        "Disk-tier records (one per rank) the background scrub read and checked.",
        domains=None,  # appears with the scrub's first record
    ),
    Metric(
        "disk_scrub_damaged",
        COUNTER,
        "Disk-tier chunks the scrub found damaged (removed and forgotten before a load found them).",
        domains=None,
    ),
)
# per tenant (cache salt or tags, as a short id; connector/engine/tenants.py): the first
# tenant_labels_max tenants seen have their own label, later ones count under "other"
_DEFINITIONS += (
    Metric(
        "tenant_lookup_tokens",
        COUNTER,
        "Prompt tokens looked up, by tenant (default: no salt or tag; other: beyond tenant_labels_max).",
        ("tenant",),
        domains=("tenants",),
    ),
    Metric(
        "tenant_hit_tokens",
        COUNTER,
        "Prompt tokens KVLens held at lookup, by tenant (the responses' num_lmcache_cached_tokens).",
        ("tenant",),
        domains=("tenants",),
    ),
    Metric(
        "tenant_load_tokens",
        COUNTER,
        "Tokens whose KV KVLens loaded into vLLM, by tenant.",
        ("tenant",),
        domains=("tenants",),
    ),
    Metric(
        "tenant_bytes",
        GAUGE,
        "Bytes each tenant's chunks hold in each indexed tier (one rank's share; chunks this engine "
        "stored or promoted).",
        ("tenant", "tier"),
        domains=("tenants", "indexed_tiers"),
    ),
)
# client-sized state refused (connector/engine/tenants.py REFUSAL_REASONS): a request whose
# cache salt or tags are over their bounds, served without KVLens; a namespace not remembered
_OWN_DOMAINS["tenant_refusal_reasons"] = ("salt_too_long", "tag_too_long", "too_many_tags", "namespaces_full")
_DEFINITIONS += (
    Metric(
        "tenant_refusals",
        COUNTER,
        "Requests served without KVLens because their cache salt or tags exceed cache_salt_max_chars, "
        "tag_value_max_chars or tags_max, and namespaces not remembered past namespaces_max, by reason.",
        ("reason",),
        domains=("tenant_refusal_reasons",),
    ),
)
# prefill/decode disaggregation (connector/pd/, telemetry/pd_recorder.py): the scheduler of a
# prefiller (side "send") or of a decoder (side "receive") reports these; buffer_* are the
# decoder's receive buffer over every rank (entries is the leak gauge: 0 when idle)
_OWN_DOMAINS["pd_sides"] = ("send", "receive")
_OWN_DOMAINS["pd_outcomes"] = ("ok", "failed")
_DEFINITIONS += (
    Metric("pd_sent_bytes", COUNTER, "Record bytes PD transfers delivered to decoders (every rank)."),
    Metric(
        "pd_received_bytes", COUNTER, "Record bytes the decoder's PD receive buffer indexed (every rank)."
    ),
    Metric(
        "pd_send_seconds", HISTOGRAM, "Seconds per PD transfer on a prefiller rank.", buckets=SECONDS_BUCKETS
    ),
    Metric(
        "pd_receive_seconds",
        HISTOGRAM,
        "Seconds per PD transfer on a decoder rank, first chunk byte to last.",
        buckets=SECONDS_BUCKETS,
    ),
    Metric(
        "pd_notify_wait_seconds",
        HISTOGRAM,
        "Seconds from a decoder's records being indexed to the lookup of the request that loaded them.",
        buckets=SECONDS_BUCKETS,
    ),
    Metric(
        "pd_transfers",
        COUNTER,
        "PD transfers that ended, by side and outcome (one per rank).",
        ("side", "outcome"),
        domains=("pd_sides", "pd_outcomes"),
    ),
    Metric(
        "pd_failed_transfers",
        COUNTER,
        "PD transfers that failed or were refused, by side and reason (buffer_full, too_large, mismatch, "
        "unreachable, timeout, peer_closed, checksum, shutdown; spec_refused:<why>, load_failed, ...).",
        ("side", "reason"),
        domains=None,
    ),
    Metric(
        "pd_transfers_in_flight",
        GAUGE,
        "PD transfers handed over and not ended yet, by side.",
        ("side",),
        domains=("pd_sides",),
    ),
    Metric("pd_buffer_used_bytes", GAUGE, "Bytes of the decoder's PD receive buffer held (every rank)."),
    Metric("pd_buffer_capacity_bytes", GAUGE, "Bytes of the decoder's PD receive buffer (every rank)."),
    Metric(
        "pd_buffer_entries",
        GAUGE,
        "Chunk records held in the decoder's PD receive buffer (received, not yet loaded and released, "
        "nor expired): back to 0 when idle.",
    ),
    Metric(
        "pd_loaded_tokens",
        COUNTER,
        "Prompt tokens the decoder loaded from its PD receive buffer: KV a prefiller computed.",
    ),
    Metric(
        "pd_loads",
        COUNTER,
        "Decoder requests by what PD gave them: loaded, failed (recomputed), expired (records unclaimed).",
        ("outcome",),
        domains=None,
    ),
)
# blending (connector/scheduler/blend_scheduler.py): per blended request, from the workers' report;
# a chunk a blend could not read counts in failed_chunks (operation "load")
_OWN_DOMAINS["blend_outcomes"] = ("blended", "failed")
_OWN_DOMAINS["blend_token_kinds"] = ("reused", "recomputed", "recomputed_by_deviation", "not_stored")
_OWN_DOMAINS["tenant_blend_kinds"] = ("reused", "recomputed")
DEVIATION_BUCKETS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0)
_DEFINITIONS += (
    Metric(
        "blend_requests",
        COUNTER,
        "Requests blended (enable_blending), by outcome: blended, or failed (vLLM computed the prompt).",
        ("outcome",),
        domains=("blend_outcomes",),
    ),
    Metric(
        "blend_tokens",
        COUNTER,
        "Prompt tokens of blended requests, by kind: reused (KV from a tier), recomputed (of which "
        "recomputed_by_deviation: reused tokens whose K deviated most, and not_stored: tokens no chunk "
        "supplied).",
        ("kind",),
        domains=("blend_token_kinds",),
    ),
    Metric(
        "blend_recomputed_ratio",
        HISTOGRAM,
        "Per blended request, the share of its prompt tokens the blend computed.",
        buckets=RATIO_BUCKETS,
    ),
    Metric(
        "blend_deviation",
        HISTOGRAM,
        "Per blended request, the mean K deviation of its reused tokens at the first check layer "
        "(squared L2 over heads and head size).",
        buckets=DEVIATION_BUCKETS,
    ),
    Metric(
        "tenant_blend_tokens",
        COUNTER,
        "Prompt tokens of blended requests, by tenant and kind: reused (KV from a tier) or recomputed.",
        ("tenant", "kind"),
        domains=("tenants", "tenant_blend_kinds"),
    ),
)
_NOT_IN_LOG_LINE = ("info", "whatif_hit_ratio")  # labels, not amounts: kept out of vLLM's log line
_NOT_IN_LOG_LINE += ("tenant_bytes",)  # a value per tenant and tier: too many for one line
_NOT_IN_LOG_LINE += ("pd_buffer_capacity_bytes",)  # a setting, not an amount

METRICS: dict[str, Metric] = {m.key: m for m in _DEFINITIONS}
NAMES = frozenset(m.name for m in _DEFINITIONS)


def wire_key(key: str, *labels: str) -> str:
    return SEP.join((key, *labels)) if labels else key


def rank_key(key: str, rank: int) -> str:
    """The wire key of a gauge one rank reports for itself (summed over ranks)."""
    return f"{key}{RANK_SEP}{rank}"


class StatsBuffer:
    """Numbers collected between two ``take()`` calls, as plain dicts."""

    __slots__ = ("counters", "gauges", "histograms")

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self.gauges: dict[str, float] = {}
        self.histograms: dict[str, list[float]] = {}

    def inc(self, key: str, value: float = 1) -> None:
        if value:
            self.counters[key] = self.counters.get(key, 0) + value

    def touch(self, key: str) -> None:
        """Ship a counter at +0: its series then exists (at 0) on /metrics."""
        self.counters.setdefault(key, 0)

    def observe(self, key: str, value: float) -> None:
        bucket = self.histograms.get(key)
        if bucket is None:
            self.histograms[key] = [value]
        else:
            bucket.append(value)

    def set(self, key: str, value: float) -> None:
        self.gauges[key] = value

    def is_empty(self) -> bool:
        return not (self.counters or self.gauges or self.histograms)

    def take(self) -> dict[str, Any] | None:
        if self.is_empty():
            return None
        data = {"counters": self.counters, "gauges": self.gauges, "histograms": self.histograms}
        self.counters, self.gauges, self.histograms = {}, {}, {}
        return data


def empty_payload() -> dict[str, Any]:
    return {"counters": {}, "gauges": {}, "histograms": {}}


def merge_payload(into: dict[str, Any], other: Mapping[str, Any]) -> dict[str, Any]:
    """Counters add, gauges take the other's value, histogram observations concatenate."""
    counters = into.setdefault("counters", {})
    for k, v in other.get("counters", {}).items():
        counters[k] = counters.get(k, 0) + v
    into.setdefault("gauges", {}).update(other.get("gauges", {}))
    histograms = into.setdefault("histograms", {})
    for k, values in other.get("histograms", {}).items():
        histograms.setdefault(k, []).extend(values)
    return into


def payload_is_empty(data: Mapping[str, Any]) -> bool:
    return not (data.get("counters") or data.get("gauges") or data.get("histograms"))


def reduce_payload(data: Mapping[str, Any]) -> dict[str, int | float]:
    """A short summary for vLLM's periodic 'KV Transfer metrics:' log line."""
    totals: dict[str, float] = {}
    for k, v in data.get("counters", {}).items():
        key = k.split(SEP, 1)[0]
        totals[key] = totals.get(key, 0) + v
    out: dict[str, int | float] = {k: _num(v) for k, v in sorted(totals.items())}
    lookup_tokens = totals.get("lookup_tokens", 0)
    if lookup_tokens:
        out["hit_rate"] = round(totals.get("hit_tokens", 0) / lookup_tokens, 4)
    for k, values in sorted(data.get("histograms", {}).items()):
        if values and k.startswith("operation_seconds" + SEP):
            op = k.split(SEP, 1)[1]
            out[f"{op}_count"] = len(values)
            out[f"{op}_avg_ms"] = round(1000 * sum(values) / len(values), 3)
    gauges: dict[str, float] = {}
    for k, v in data.get("gauges", {}).items():
        if k.split(SEP, 1)[0] in _NOT_IN_LOG_LINE:
            continue
        name = k.partition(RANK_SEP)[0].replace(SEP, ":")
        gauges[name] = gauges.get(name, 0) + v
    for k, v in sorted(gauges.items()):
        out[k] = _num(v)
    return out


def _num(v: float) -> int | float:
    return int(v) if float(v).is_integer() else round(v, 6)


class PromRecorder:
    """Prometheus families for every KVLens metric, fed with stats payloads.

    ``metric_types`` maps prometheus_client's Counter/Gauge/Histogram to the classes to
    instantiate (vLLM passes its own; the offline exporter passes registry-bound ones).
    Registration is idempotent: a family that already exists (a second connector instance
    in the same process) is reused instead of raising "Duplicated timeseries".
    """

    def __init__(
        self,
        metric_types: Mapping[type, Callable[..., Any]],
        labelnames: list[str],
        per_engine_labelvalues: Mapping[int, list[object]],
        known: Any = None,
        registry: Any = None,
    ) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self._per_engine = {e: [str(v) for v in vals] for e, vals in per_engine_labelvalues.items()}
        self._families: dict[str, Any] = {}
        self._children: dict[tuple[int, str], Any] = {}
        self._by_rank: dict[tuple[int, str], dict[str, float]] = {}
        self._warned: set[str] = set()
        cls = {COUNTER: metric_types[Counter], GAUGE: metric_types[Gauge], HISTOGRAM: metric_types[Histogram]}
        for metric in _DEFINITIONS:
            kwargs: dict[str, Any] = {
                "name": metric.name,
                "documentation": metric.doc,
                "labelnames": list(labelnames) + list(metric.labels),
            }
            if metric.kind == GAUGE:
                kwargs["multiprocess_mode"] = "mostrecent"
            if metric.buckets is not None:
                kwargs["buckets"] = metric.buckets
            self._families[metric.key] = _register(cls[metric.kind], kwargs, registry)
        if known is not None:
            self._prebind(known)

    def _prebind(self, known: KnownLabels) -> None:
        """Create, at zero, every series whose label values are all known in advance (Prometheus's
        advice: panels show 0 instead of "No data" and ``rate()`` sees the first event)."""
        for metric in _DEFINITIONS:
            domains = metric.label_domains()
            if domains is None:
                continue
            values = [_OWN_DOMAINS.get(d) or tuple(getattr(known, d)) for d in domains]
            for combination in itertools.product(*values):
                for engine in self._per_engine:
                    self._child(engine, wire_key(metric.key, *combination))

    def _child(self, engine: int, key: str) -> Any:
        child = self._children.get((engine, key))
        if child is not None:
            return child
        short, *labels = key.split(SEP)
        metric = METRICS.get(short)
        if metric is None or len(labels) != len(metric.labels) or engine not in self._per_engine:
            if key not in self._warned:
                self._warned.add(key)
                logger.warning("KVLens: ignoring unknown stats key %r (engine %s)", key, engine)
            return None
        child = self._families[short].labels(*self._per_engine[engine], *labels)
        self._children[(engine, key)] = child
        return child

    def observe(self, data: Mapping[str, Any], engine: int = 0) -> None:
        for key, value in data.get("counters", {}).items():
            child = self._child(engine, key)
            if child is not None and value > 0:
                child.inc(value)
        for key, value in data.get("gauges", {}).items():
            key, _, rank = key.partition(RANK_SEP)
            child = self._child(engine, key)
            if child is None:
                continue
            if rank:
                ranks = self._by_rank.setdefault((engine, key), {})
                ranks[rank] = value
                value = sum(ranks.values())
            child.set(value)
        for key, values in data.get("histograms", {}).items():
            child = self._child(engine, key)
            if child is not None:
                for v in values:
                    child.observe(v)


def _register(factory: Callable[..., Any], kwargs: dict[str, Any], registry: Any) -> Any:
    try:
        return factory(**kwargs)
    except ValueError as e:
        if "Duplicated timeseries" not in str(e):
            raise
    if registry is None:
        from prometheus_client import REGISTRY as registry
    existing = registry._names_to_collectors.get(kwargs["name"])  # noqa: SLF001
    if existing is None:
        raise RuntimeError(f"KVLens: metric {kwargs['name']} is registered under another name")
    return existing


class LocalExporter:
    """KVLens metrics on 127.0.0.1:``port`` from a private registry, for engines whose stats
    vLLM does not publish (the offline ``vllm.LLM``). Lives in the engine-core process."""

    def __init__(self, port: int, model_name: str, engine: str, known: KnownLabels | None = None) -> None:
        from functools import partial

        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

        self.registry = CollectorRegistry()
        types = {c: partial(c, registry=self.registry) for c in (Counter, Gauge, Histogram)}
        self._recorder = PromRecorder(
            types, ["model_name", "engine"], {0: [model_name, engine]}, known, self.registry
        )
        self._server, _thread = start_http_server(port, addr="127.0.0.1", registry=self.registry)
        self.port = self._server.server_address[1]
        logger.info("KVLens: metrics on http://127.0.0.1:%d/metrics", self.port)

    def observe(self, data: Mapping[str, Any]) -> None:
        self._recorder.observe(data, 0)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
