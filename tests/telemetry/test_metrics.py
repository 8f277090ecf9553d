"""The stats payload and its Prometheus side, without vLLM."""

from __future__ import annotations

import pickle
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from connector.engine.snapshots import KnownLabels
from telemetry.metrics import (
    COUNTER,
    GAUGE,
    METRICS,
    PromRecorder,
    StatsBuffer,
    merge_payload,
    payload_is_empty,
    reduce_payload,
    wire_key,
)

# storage: one value per shared disk directory
# tenant: at most extra_config.tenant_labels_max values plus default and other (tenants.py)
ALLOWED_LABELS = {
    "tier",
    "operation",
    "reason",
    "kind",
    "budget_factor",
    "stage",
    "storage",
    "tenant",
    "retention",
    "side",  # PD: send | receive
    "outcome",  # PD: ok | failed; loaded | failed | expired
}
# The info metric's labels are fixed for the life of the engine: one series per instance.
INFO_LABELS = {
    "version",
    "chunk_size",
    "key_fingerprint",
    "tiers",
    "role",
    "storage",
    "model_identity",
    "quantization",
    "kv_cache_dtype",
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
}


def recorder(tiers=("cpu",)) -> tuple[PromRecorder, CollectorRegistry]:
    registry = CollectorRegistry()
    types = {c: partial(c, registry=registry) for c in (Counter, Gauge, Histogram)}
    rec = PromRecorder(
        types, ["model_name", "engine"], {0: ["tiny", "0"]}, KnownLabels.for_tiers(tiers), registry
    )
    return rec, registry


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_every_metric_is_named_under_vllm_kvlens_with_bounded_labels():
    for metric in METRICS.values():
        assert metric.name.startswith("vllm:kvlens_")
        allowed = INFO_LABELS if metric.key == "info" else ALLOWED_LABELS
        assert set(metric.labels) <= allowed, metric.key
        assert "request" not in "".join(metric.labels)  # never an id as a label


def test_counters_add_gauges_take_latest_histograms_concatenate():
    a, b = StatsBuffer(), StatsBuffer()
    a.inc("lookup_requests")
    a.inc(wire_key("hit_tokens", "cpu"), 256)
    a.set("request_trackers", 3)
    a.observe("operation_seconds|load", 0.01)
    b.inc("lookup_requests", 2)
    b.set("request_trackers", 0)
    b.observe("operation_seconds|load", 0.02)
    merged = merge_payload(a.take(), b.take())
    assert merged["counters"] == {"lookup_requests": 3, "hit_tokens|cpu": 256}
    assert merged["gauges"] == {"request_trackers": 0}
    assert merged["histograms"] == {"operation_seconds|load": [0.01, 0.02]}
    assert a.take() is None and a.is_empty()


def test_payload_survives_pickle_and_has_only_string_keys():
    b = StatsBuffer()
    b.inc(wire_key("failed_chunks", "load", "disk", "corrupt"))
    b.observe("request_hit_ratio", 0.5)
    data = b.take()
    assert pickle.loads(pickle.dumps(data)) == data
    for section in data.values():
        assert all(isinstance(k, str) for k in section)


def test_reduce_summarises_for_the_log_line():
    b = StatsBuffer()
    b.inc("lookup_tokens", 1000)
    b.inc(wire_key("hit_tokens", "cpu"), 300)
    b.inc(wire_key("hit_tokens", "disk"), 200)
    b.observe("operation_seconds|load", 0.002)
    b.observe("operation_seconds|load", 0.004)
    b.set(wire_key("pinned_chunks", "cpu"), 0)
    out = reduce_payload(b.take())
    assert out["hit_tokens"] == 500 and out["hit_rate"] == 0.5
    assert out["load_count"] == 2 and out["load_avg_ms"] == 3.0
    assert out["pinned_chunks:cpu"] == 0
    assert payload_is_empty({"counters": {}, "gauges": {}, "histograms": {}})


def test_recorder_exposes_payload_as_labelled_series():
    rec, registry = recorder()
    b = StatsBuffer()
    b.inc(wire_key("load_tokens", "cpu"), 512)
    b.inc(wire_key("miss_requests", "evicted"))
    b.set(wire_key("tier_used_bytes", "cpu", ""), 4096)
    b.set(wire_key("tier_used_bytes", "disk", "disk:1a2b3c4d"), 8192)
    b.observe("operation_seconds|lookup", 0.0003)
    rec.observe(b.take(), 0)
    got = samples(registry)
    base = (("engine", "0"), ("model_name", "tiny"))
    assert got[("vllm:kvlens_load_tokens_total", tuple(sorted(base + (("tier", "cpu"),))))] == 512
    assert got[("vllm:kvlens_miss_requests_total", tuple(sorted(base + (("reason", "evicted"),))))] == 1
    cpu = tuple(sorted(base + (("storage", ""), ("tier", "cpu"))))
    assert got[("vllm:kvlens_tier_used_bytes", cpu)] == 4096
    disk = tuple(sorted(base + (("storage", "disk:1a2b3c4d"), ("tier", "disk"))))
    assert got[("vllm:kvlens_tier_used_bytes", disk)] == 8192
    key = ("vllm:kvlens_operation_seconds_count", tuple(sorted(base + (("operation", "lookup"),))))
    assert got[key] == 1


def test_series_without_traffic_exist_at_zero():
    _, registry = recorder(tiers=("cpu", "disk"))
    got = samples(registry)
    base = (("engine", "0"), ("model_name", "tiny"))
    assert got[("vllm:kvlens_request_trackers", base)] == 0
    assert got[("vllm:kvlens_pinned_chunks", tuple(sorted(base + (("tier", "disk"),))))] == 0
    assert got[("vllm:kvlens_lookup_requests_total", base)] == 0
    names = {name for name, _ in got}
    for metric in METRICS.values():
        if not metric.labels and metric.domains is not None:  # None: unknown until measured
            suffix = "_total" if metric.kind == COUNTER else ("" if metric.kind == GAUGE else "_count")
            assert metric.name + suffix in names, metric.name


def test_unknown_or_malformed_keys_are_ignored():
    rec, registry = recorder()
    rec.observe({"counters": {"no_such_metric": 1, "load_tokens": 5}, "gauges": {}, "histograms": {}}, 0)
    assert ("vllm:kvlens_load_tokens_total", ()) not in samples(registry)


def test_a_second_recorder_in_the_same_registry_reuses_the_families():
    registry = CollectorRegistry()
    types = {c: partial(c, registry=registry) for c in (Counter, Gauge, Histogram)}
    first = PromRecorder(types, ["model_name", "engine"], {0: ["tiny", "0"]}, None, registry)
    second = PromRecorder(types, ["model_name", "engine"], {0: ["tiny", "0"]}, None, registry)
    first.observe({"counters": {"lookup_requests": 1}}, 0)
    second.observe({"counters": {"lookup_requests": 2}}, 0)
    base = (("engine", "0"), ("model_name", "tiny"))
    assert samples(registry)[("vllm:kvlens_lookup_requests_total", base)] == 3


def test_gauges_declare_a_multiprocess_mode():
    rec, _ = recorder()
    for key, metric in METRICS.items():
        if metric.kind == GAUGE:
            assert rec._families[key]._multiprocess_mode == "mostrecent"
