"""The connector's typed gauge records as wire keys of the stats payload (``metrics.py``).

Only telemetry spells metric keys: a record field that is renamed or added without a line
here fails ``tests/telemetry/test_records.py`` instead of silently dropping a series.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .metrics import METRICS, SEP, wire_key

if TYPE_CHECKING:
    from connector.engine.snapshots import InsightSnapshot, InstanceInfo, SchedulerSizes, WorkerSizes
    from connector.engine.tenants import TenantUsage

_TIER_FIELDS = (  # (field, metric key, labelled with the storage it describes)
    ("chunks", "tier_chunks", True),
    ("used_bytes", "tier_used_bytes", True),
    ("capacity_bytes", "tier_capacity_bytes", True),
    ("pinned_chunks", "pinned_chunks", False),
    ("pinned_bytes", "pinned_bytes", False),
)
_SCHEDULER_FIELDS = (
    "request_trackers",
    "load_specs",
    "unfinished_requests",
    "pinned_requests",
    "pending_saves",
    "suspect_blocks",
    "pending_writes",
)
_WORKER_FIELDS = ("invalid_block_ids", "reusable_buffer_bytes")


def label_value(value: object) -> str:
    """A label value as it travels inside a wire key (the separator cannot occur in it)."""
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return text.replace(SEP, "/")


def scheduler_gauges(sizes: SchedulerSizes, insight: InsightSnapshot | None) -> dict[str, float]:
    out: dict[str, float] = {key: getattr(sizes, key) for key in _SCHEDULER_FIELDS}
    for t in sizes.tiers:
        tier = label_value(t.tier)
        out[wire_key("tier_health", tier)] = t.health.level
        for field, key, shared in _TIER_FIELDS:
            value = getattr(t, field)
            if value is not None:
                labels = (tier, label_value(t.storage)) if shared else (tier,)
                out[wire_key(key, *labels)] = value
    for r in sizes.retention:
        for retention, nbytes in enumerate(r.bytes_by_class):
            out[wire_key("retention_bytes", label_value(r.tier), str(retention))] = nbytes
    if insight is not None:
        out.update(insight_gauges(insight))
    return out


RETENTION_COUNTERS = (  # (TierRetention field, counter key): cumulative there, increments here
    ("retained_evictions", "retained_evictions"),
    ("demotions", "retention_demotions"),
    ("quota_evictions", "quota_evictions"),
    ("quota_refusals", "quota_refusals"),
)


def retention_counts(sizes: SchedulerSizes) -> dict[str, int]:
    """The retention counters' (and the disk scrub's) cumulative values, by wire key."""
    out = {
        wire_key(key, label_value(r.tier)): getattr(r, field)
        for r in sizes.retention
        for field, key in RETENTION_COUNTERS
    }
    if sizes.disk_scrubbed_records:
        out["disk_scrubbed_records"] = sizes.disk_scrubbed_records
    if sizes.disk_scrub_damaged:
        out["disk_scrub_damaged"] = sizes.disk_scrub_damaged
    return out


def insight_gauges(insight: InsightSnapshot) -> dict[str, float]:
    out: dict[str, float] = {info_key(insight.info): 1}
    if insight.prefill_seconds_per_token is not None:
        out["prefill_seconds_per_token"] = insight.prefill_seconds_per_token
    for p in insight.whatif:
        out[wire_key("whatif_hit_ratio", label_value(p.tier), label_value(p.budget_factor))] = p.hit_ratio
    return out


def info_key(info: InstanceInfo) -> str:
    """The info gauge's wire key: its labels, in the metric's order, read off the record."""
    return wire_key("info", *(label_value(getattr(info, label)) for label in METRICS["info"].labels))


def worker_gauges(sizes: WorkerSizes) -> dict[str, float]:
    out: dict[str, float] = {key: getattr(sizes, key) for key in _WORKER_FIELDS}
    if sizes.cpu_tier_bytes is not None:
        out[wire_key("tier_stored_bytes", "cpu")] = sizes.cpu_tier_bytes
    return out


_TENANT_COUNTERS = (  # (TenantUsage field, metric key)
    ("lookup_tokens", "tenant_lookup_tokens"),
    ("hit_tokens", "tenant_hit_tokens"),
    ("load_tokens", "tenant_load_tokens"),
)


def tenant_counters(usage: TenantUsage) -> dict[str, float]:
    out: dict[str, float] = {}
    for field, key in _TENANT_COUNTERS:
        for label, n in getattr(usage, field).items():
            out[wire_key(key, label_value(label))] = n
    for reason, n in usage.refusals.items():
        out[wire_key("tenant_refusals", label_value(reason))] = n
    for (label, kind), n in usage.blend_tokens.items():
        out[wire_key("tenant_blend_tokens", label_value(label), kind)] = n
    return out


def tenant_gauges(usage: TenantUsage) -> dict[str, float]:
    return {
        wire_key("tenant_bytes", label_value(label), label_value(tier)): n
        for (label, tier), n in usage.bytes_held.items()
    }
