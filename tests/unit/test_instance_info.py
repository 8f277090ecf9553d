"""The info gauge's PD fields (connector/scheduler/instance_info.py): what kvlens doctor needs to
say whether a prefiller and a decoder can pair, read from the PD settings by LMCache's names."""

from __future__ import annotations

import dataclasses

from connector.config.loading import load_config
from connector.engine.facts import EngineFacts
from connector.scheduler.instance_info import instance_info


def _pd(**pd) -> object:
    """A configuration loaded as an engine loads it, with these LMCache PD keys."""
    settings = {"enable_pd": True, "transfer_channel": "tcp", "local_cpu": False, **pd}
    return load_config({f"lmcache.{k}": v for k, v in settings.items()}, env={})


DECODER = dict(
    pd_role="receiver",
    pd_peer_host="10.0.0.2",
    pd_peer_init_port=[7300, 7301],
    pd_peer_alloc_port=[7400, 7401],
    pd_buffer_size=1 << 30,
    pd_buffer_device="cpu",
    pd_auth_key="the pair's PD key, long enough",  # beyond loopback, a key or no start
)


def _facts(role: str, tp: int = 2, layout: str = "layout-a") -> EngineFacts:
    return EngineFacts("tiny", "bfloat16", 16, 4, 4096, layout, tp, role)


def test_without_pd_the_existing_labels_are_unchanged_and_pd_is_off():
    config = load_config({}, env={})
    info = instance_info(config, _facts("kv_both"))
    assert (info.pd_role, info.pd_host, info.pd_init_ports, info.pd_proxy, info.pd_buffer_size) == (
        "",
        "",
        "",
        "",
        0,
    )
    assert (info.tp_size, info.block_size, info.chunk_size) == (2, 16, 256)
    assert info.record_layout == _facts("kv_both").record_layout()
    assert info.role == "kv_both" and len(info.key_fingerprint) == 12
    names = [f.name for f in dataclasses.fields(info)]
    assert names[:9] == [
        "version",
        "chunk_size",
        "key_fingerprint",
        "tiers",
        "role",
        "storage",
        "model_identity",
        "quantization",
        "kv_cache_dtype",
    ]


def test_a_decoder_publishes_its_ports_and_buffer_a_prefiller_its_proxy():
    decoder = _pd(**DECODER)
    info = instance_info(decoder, _facts("kv_consumer"))
    assert (info.pd_role, info.pd_host, info.pd_init_ports, info.pd_alloc_ports) == (
        "receiver",
        "10.0.0.2",
        "7300,7301",
        "7400,7401",
    )
    assert info.pd_buffer_size == 1 << 30 and info.pd_proxy == ""
    assert (info.pd_auth, info.pd_tls) == ("key", "")
    prefiller = _pd(
        pd_role="sender",
        pd_proxy_host="10.0.0.9",
        pd_proxy_port=7500,
        pd_buffer_device="cpu",
        pd_buffer_size=1 << 20,
    )
    info = instance_info(prefiller, _facts("kv_producer"))
    assert (info.pd_role, info.pd_proxy, info.pd_init_ports) == ("sender", "10.0.0.9:7500", "")
    assert info.pd_auth == "loopback"  # no key: it sends to loopback only
    open_door = _pd(**{**DECODER, "pd_auth_key": None, "pd_allow_unauthenticated": True})
    assert instance_info(open_door, _facts("kv_consumer")).pd_auth == "unauthenticated"
    off = _pd(enable_pd=False, local_cpu=True, pd_role="sender", pd_proxy_host="h", pd_proxy_port=1)
    assert instance_info(off, _facts("kv_producer")).pd_role == ""


def test_the_record_layout_differs_with_what_the_record_bytes_hold():
    base = _facts("kv_both").record_layout()
    assert base.startswith("kvlens-record-1/bfloat16/4x4096/")
    assert _facts("kv_both", layout="layout-b").record_layout() != base
    assert (dataclasses.replace(_facts("kv_both"), dtype="float16")).record_layout() != base
    assert _facts("kv_consumer", tp=1).record_layout() == base  # TP size is its own field


def test_the_pd_fields_reach_the_info_gauge_on_metrics():
    from functools import partial

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from connector.engine.snapshots import InsightSnapshot, KnownLabels
    from connector.ops import doctor
    from telemetry.encoding import insight_gauges
    from telemetry.metrics import PromRecorder

    decoder = _pd(**DECODER)
    info = instance_info(decoder, _facts("kv_consumer"))
    registry = CollectorRegistry()
    types = {c: partial(c, registry=registry) for c in (Counter, Gauge, Histogram)}
    rec = PromRecorder(
        types, ["model_name", "engine"], {0: ["tiny", "0"]}, KnownLabels.for_tiers(("cpu",)), registry
    )
    rec.observe({"counters": {}, "gauges": insight_gauges(InsightSnapshot(info, None)), "histograms": {}}, 0)
    text = generate_latest(registry).decode()
    samples = [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]
    (found,) = doctor.instances("http://d:8200", samples)
    assert found.pd_role == "receiver"
    assert {
        k: found.info[k]
        for k in ("tp_size", "block_size", "pd_init_ports", "pd_alloc_ports", "pd_buffer_size")
    } == {
        "tp_size": "2",
        "block_size": "16",
        "pd_init_ports": "7300,7301",
        "pd_alloc_ports": "7400,7401",
        "pd_buffer_size": str(1 << 30),
    }
    assert found.info["record_layout"] == info.record_layout
