"""KVLens's stats types against vLLM's own classes and serialisation (no engine started)."""

from __future__ import annotations

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
