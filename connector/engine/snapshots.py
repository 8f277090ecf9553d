"""What the halves report for gauges and labels, as typed values; telemetry encodes them.

The connector never spells a metric's name or wire key: it fills these records and the
facade hands them to telemetry, which owns the encoding (``telemetry/encoding.py``). A field
is meant for a metric unless its comment says otherwise; a test checks that each one reaches
a series (``tests/telemetry/test_records.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .outcomes import (
    REMOTE_ERROR_KINDS,
    REMOTE_OPERATIONS,
    FailureReason,
    MissReason,
    SaveSkipReason,
    Stage,
    TierState,
)
from .retention import CLASSES as RETENTION_CLASSES
from .retention_rules import REFUSALS as RETENTION_REFUSALS


@dataclass(frozen=True, slots=True)
class TierGauge:
    """One tier as the scheduler sees it. The remote tier has no index here (lookups ask the
    store itself), so only its health is known."""

    tier: str
    health: TierState
    chunks: int | None = None  # None: not indexed by the scheduler (remote)
    used_bytes: int | None = None  # one rank's share
    capacity_bytes: int | None = None  # one rank's share
    pinned_chunks: int | None = None  # pinned by pending loads
    pinned_bytes: int | None = None
    storage: str = ""  # a store engines share (a disk directory's id): dashboards take the max


@dataclass(frozen=True, slots=True)
class TierRetention:
    """Retention in one tier KVLens evicts (``retention.py``): bytes held per class now, and
    counts since start-up (telemetry counts what they grew by)."""

    tier: str
    bytes_by_class: tuple[int, ...]  # by retention priority, 0 (normal) first
    retained_evictions: int  # chunks evicted although retained: nothing unretained was left
    demotions: int  # retained chunks made normal by max_retained_share
    quota_evictions: int  # chunks a tenant at its quota evicted of its own
    quota_refusals: int  # chunks not stored: their tenant's own could not make room


@dataclass(frozen=True, slots=True)
class SchedulerSizes:
    """The scheduler half's internal sizes: each returns to zero once the engine drains."""

    request_trackers: int
    load_specs: int
    unfinished_requests: int
    pinned_requests: int
    pending_saves: int
    suspect_blocks: int
    # Background writes and deletes queued on the busiest rank, as the workers last reported:
    # what keeps an idle engine stepping until they land (so it is exact when the engine stops).
    pending_writes: int = 0
    tiers: tuple[TierGauge, ...] = ()
    retention: tuple[TierRetention, ...] = ()
    # The disk scrub's totals since start-up (counters; connector/scheduler/disk_scrub.py): rank records
    # read and checked, and chunks found damaged (removed).
    disk_scrubbed_records: int = 0
    disk_scrub_damaged: int = 0


@dataclass(frozen=True, slots=True)
class WorkerSizes:
    """One worker rank's internal sizes (summed over ranks by telemetry)."""

    invalid_block_ids: int
    reusable_buffer_bytes: int
    cpu_tier_bytes: int | None = None  # what this rank's CPU tier holds; None without one


@dataclass(frozen=True, slots=True)
class WhatIfPoint:
    """The estimated hit ratio of ``tier`` at ``budget_factor`` times its configured size."""

    tier: str
    budget_factor: float
    hit_ratio: float


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    """What decides whether two instances can share KV (the labels of the info gauge)."""

    version: str
    chunk_size: int
    key_fingerprint: str
    tiers: str  # "cpu+disk"
    role: str
    storage: str
    model_identity: str
    quantization: str
    kv_cache_dtype: str
    # PD (prefill/decode disaggregation): whether a prefiller and a decoder can pair. The key
    # space is key_fingerprint; "" and 0: not known, or PD off (pd_role "").
    pd_role: str = ""  # "sender" (prefiller), "receiver" (decoder), "" (PD off)
    tp_size: int = 0  # tensor-parallel size: rank r sends to rank r
    block_size: int = 0  # tokens per vLLM block
    record_layout: str = ""  # what one rank's record bytes hold: dtype, layers, bytes per block, layout
    pd_host: str = ""  # receiver: the host its PD ports are bound on
    pd_init_ports: str = ""  # receiver: one port per rank, comma-separated
    pd_alloc_ports: str = ""
    pd_buffer_size: int = 0  # receiver: receive buffer bytes per rank
    pd_proxy: str = ""  # sender: host:port of the proxy it notifies
    # who may hand this decoder KV, or to whom this prefiller sends: "key" (both ends prove the PD
    # key), "loopback" (no key: loopback only), "unauthenticated" (pd_allow_unauthenticated)
    pd_auth: str = ""
    pd_tls: str = ""  # "on" when PD connections run inside TLS


@dataclass(frozen=True, slots=True)
class InsightSnapshot:
    """The scheduler's answers beyond hits and misses, as of now."""

    info: InstanceInfo
    prefill_seconds_per_token: float | None  # None: not measured yet (no series: "unknown")
    whatif: tuple[WhatIfPoint, ...] = ()


@dataclass(frozen=True, slots=True)
class KnownLabels:
    """Every value a closed label can take, so that each series exists at zero from start-up.

    Families labelled by tier get only the configured tiers; the remote tier's round-trip
    families exist only when a remote tier is configured.
    """

    tiers: tuple[str, ...]
    indexed_tiers: tuple[str, ...] = ()  # tiers whose chunks the scheduler indexes (not remote)
    failure_reasons: tuple[str, ...] = tuple(r.value for r in FailureReason)
    miss_reasons: tuple[str, ...] = tuple(r.value for r in MissReason)
    save_skip_reasons: tuple[str, ...] = tuple(r.value for r in SaveSkipReason)
    transfer_stages: tuple[str, ...] = tuple(s.value for s in Stage)
    remote_operations: tuple[str, ...] = ()
    remote_error_kinds: tuple[str, ...] = ()
    tenants: tuple[str, ...] = ("default", "other")  # the labels every engine has (tenants.py)
    retention_classes: tuple[str, ...] = RETENTION_CLASSES
    retention_refusals: tuple[str, ...] = RETENTION_REFUSALS

    @classmethod
    def for_tiers(cls, tiers: tuple[str, ...]) -> KnownLabels:
        remote = "remote" in tiers
        return cls(
            tiers,
            tuple(t for t in tiers if t != "remote"),
            remote_operations=REMOTE_OPERATIONS if remote else (),
            remote_error_kinds=REMOTE_ERROR_KINDS if remote else (),
        )
