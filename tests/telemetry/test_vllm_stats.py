"""KVLens's stats types against vLLM's own classes and serialisation (no engine started)."""

from __future__ import annotations

import itertools
import pickle

from prometheus_client import REGISTRY, generate_latest

from telemetry.metrics import StatsBuffer, wire_key
from telemetry.vllm_stats import KVLensStats, wrap


def payload(**counters) -> dict:
    b = StatsBuffer()
    for k, v in counters.items():
        b.inc(k.replace("__", "|"), v)
    b.set("request_trackers", 1)
    b.observe("operation_seconds|load", 0.004)
    return b.take()


def test_stats_aggregate_like_vllm_does_across_workers_and_scheduler():
    worker = wrap(payload(store_tokens__cpu=256))
    scheduler = wrap(payload(load_tokens__cpu=512, store_tokens__cpu=256))
    merged = worker.aggregate(scheduler)
    assert merged.data["counters"] == {"store_tokens|cpu": 512, "load_tokens|cpu": 512}
    assert merged.data["histograms"]["operation_seconds|load"] == [0.004, 0.004]
    assert merged.reduce()["load_tokens"] == 512 and not merged.is_empty()
    assert wrap(None) is None and KVLensStats().is_empty()


def test_stats_cross_processes_the_way_vllm_sends_them():
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    stats = pickle.loads(pickle.dumps(wrap(payload(lookup_requests=2))))  # worker -> engine core
    out = EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=stats.to_dict()))
    received = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(out))  # -> API server
    from connector.kv_connector import KVLensConnector

    rebuilt = KVLensConnector.build_kv_connector_stats(received.scheduler_stats.kv_connector_stats)
    assert rebuilt.data == stats.data and rebuilt.reduce()["lookup_requests"] == 2


def test_build_prom_metrics_registers_on_vllms_registry_and_observes():
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    from connector.kv_connector import KVLensConnector

    class Config:
        class kv_transfer_config:  # noqa: N801
            kv_connector_extra_config = {"lmcache.local_disk": "/tmp/x", "lmcache.max_local_disk_size": 1}

    unregister_vllm_metrics()
    try:
        prom = KVLensConnector.build_prom_metrics(
            Config,
            {Counter: Counter, Gauge: Gauge, Histogram: Histogram},
            ["model_name", "engine"],
            {0: ["tiny", "0"]},
        )
        prom.observe(payload(**{wire_key("load_tokens", "disk").replace("|", "__"): 384}), 0)
        text = generate_latest(REGISTRY).decode()
        assert 'vllm:kvlens_load_tokens_total{engine="0",model_name="tiny",tier="disk"} 384.0' in text
        assert 'vllm:kvlens_evictions_total{engine="0",model_name="tiny",tier="cpu"} 0.0' in text
    finally:
        unregister_vllm_metrics()


def _series(text: str) -> set[tuple[str, tuple]]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))))
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith("vllm:kvlens_")
    }


def _build(extra_config: dict) -> set[tuple[str, tuple]]:
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    from connector.kv_connector import KVLensConnector

    class Config:
        class kv_transfer_config:  # noqa: N801
            kv_connector_extra_config = extra_config

    unregister_vllm_metrics()
    try:
        KVLensConnector.build_prom_metrics(
            Config,
            {Counter: Counter, Gauge: Gauge, Histogram: Histogram},
            ["model_name", "engine"],
            {0: ["m", "0"]},
        )
        return _series(generate_latest(REGISTRY).decode())
    finally:
        unregister_vllm_metrics()


def test_every_known_label_value_exists_at_zero_from_start_up():
    from connector.engine.outcomes import FailureReason, MissReason, SaveSkipReason

    series = _build({"lmcache.local_disk": "/tmp/x", "lmcache.max_local_disk_size": 1})
    tiers = ("cpu", "disk")
    for reason in FailureReason:
        assert ("vllm:kvlens_failed_blocks_total", (("reason", reason.value),)) in series
        for op, tier in itertools.product(("load", "store"), tiers):
            labels = (("operation", op), ("reason", reason.value), ("tier", tier))
            assert ("vllm:kvlens_failed_chunks_total", labels) in series
    for reason in MissReason:
        assert ("vllm:kvlens_miss_requests_total", (("reason", reason.value),)) in series
    for reason in SaveSkipReason:
        assert ("vllm:kvlens_save_skipped_requests_total", (("reason", reason.value),)) in series
    for op in ("lookup", "load", "store"):
        assert ("vllm:kvlens_operation_seconds_count", (("operation", op),)) in series
    names = {name for name, _ in series}
    # tiers that are not configured and the remote tier's families stay absent
    assert not any(dict(labels).get("tier") == "remote" for _, labels in series)
    assert not any(name.startswith("vllm:kvlens_remote_") for name in names)


def test_the_remote_tiers_families_exist_at_zero_when_it_is_configured():
    from connector.engine.outcomes import REMOTE_ERROR_KINDS

    series = _build({"lmcache.remote_url": "redis://127.0.0.1:6379", "lmcache.local_cpu": False})
    for op in ("exists", "get", "put", "delete"):
        assert ("vllm:kvlens_remote_seconds_count", (("operation", op),)) in series
        assert ("vllm:kvlens_remote_bytes_total", (("operation", op),)) in series
        for kind in REMOTE_ERROR_KINDS:
            assert ("vllm:kvlens_remote_errors_total", (("kind", kind), ("operation", op))) in series
    assert not any(dict(labels).get("tier") == "cpu" for _, labels in series)


def test_estimates_without_a_measurement_have_no_series():
    names = {name for name, _ in _build({})}
    assert "vllm:kvlens_prefill_seconds_per_token" not in names  # unknown, not 0
    assert not any(n.startswith("vllm:kvlens_prefill_seconds_saved") for n in names)
    assert not any(n.startswith("vllm:kvlens_whatif_hit_ratio") for n in names)
