"""The compose stack, checked statically (no container runtime here): pinned images, every
mounted file present, provisioning that needs no clicks, ports on 127.0.0.1 only."""

from __future__ import annotations

import json

import yaml

from .promql import REPO

BUNDLE = REPO / "grafana"


def compose() -> dict:
    return yaml.safe_load((BUNDLE / "compose.yaml").read_text())


def test_the_stack_has_prometheus_grafana_a_collector_and_tempo_pinned():
    services = compose()["services"]
    images = {name: s["image"] for name, s in services.items()}
    for name in ("prometheus", "grafana", "otel-collector", "tempo"):
        image = images[name]
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest" and any(ch.isdigit() for ch in tag), image


def test_every_mounted_file_exists_and_ports_bind_to_loopback():
    for name, service in compose()["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (BUNDLE / source).exists(), f"{name}: {source}"
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name}: {port}"


def test_grafana_is_provisioned_from_files():
    grafana = compose()["services"]["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"] if v.startswith("."))
    assert mounts["./provisioning"] == "/etc/grafana/provisioning"
    dashboards = yaml.safe_load((BUNDLE / "provisioning/dashboards/kvlens.yaml").read_text())
    (provider,) = dashboards["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == mounts["./dashboards"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == mounts["./dashboards"] + "/kvlens.json"
    datasources = yaml.safe_load((BUNDLE / "provisioning/datasources/kvlens.yaml").read_text())["datasources"]
    by_type = {d["type"]: d for d in datasources}
    assert by_type["prometheus"]["isDefault"] and by_type["prometheus"]["uid"]
    assert by_type["prometheus"]["jsonData"]["timeInterval"] == "5s"
    scrape = yaml.safe_load((BUNDLE / "prometheus/prometheus.yml").read_text())["global"]["scrape_interval"]
    assert scrape == "5s"
    assert by_type["tempo"]["url"].startswith("http://tempo:")


def test_traces_flow_collector_to_tempo():
    collector = yaml.safe_load((BUNDLE / "otel-collector.yaml").read_text())
    assert collector["service"]["pipelines"]["traces"]["exporters"] == ["otlp/tempo"]
    assert collector["exporters"]["otlp/tempo"]["endpoint"].startswith("tempo:")
    tempo = yaml.safe_load((BUNDLE / "tempo.yaml").read_text())
    assert tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")
    targets = json.loads((BUNDLE / "prometheus/targets/vllm.json").read_text())
    assert targets[0]["targets"] == ["host.docker.internal:8000"]
