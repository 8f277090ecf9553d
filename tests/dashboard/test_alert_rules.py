"""The Prometheus side of the bundle, checked with Debian's promtool: alert rules and their
unit tests, the scrape config, and the metric names the rules use."""

from __future__ import annotations

import re
import subprocess

import yaml

from dashboard.catalog import LEAK_GAUGES, PD_SAMPLE_NAMES, VLLM_SAMPLE_NAMES, kvlens_sample_names

from .promql import REPO, RULES, metric_names, proxy_names

PROM_DIR = REPO / "grafana" / "prometheus"


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], cwd=PROM_DIR, capture_output=True, text=True, timeout=120)


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_rules_parse():
    out = promtool("check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr


def test_rule_unit_tests_pass():
    out = promtool("test", "rules", "rules/kvlens-alerts.test.yml")
    assert out.returncode == 0, out.stdout + out.stderr


def test_rule_unit_tests_fail_when_a_rule_changes(tmp_path):
    (tmp_path / "kvlens-alerts.yml").write_text(RULES.read_text().replace("for: 15m", "for: 1m"))
    (tmp_path / "kvlens-alerts.test.yml").write_text((RULES.parent / "kvlens-alerts.test.yml").read_text())
    out = subprocess.run(
        ["promtool", "test", "rules", "kvlens-alerts.test.yml"], cwd=tmp_path, capture_output=True, text=True
    )
    assert out.returncode != 0 and "KVLensStateLeakWhileIdle" in out.stdout + out.stderr


def test_scrape_config_is_valid_and_loads_the_rules():
    out = promtool("check", "config", "prometheus.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    config = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    assert config["rule_files"] == ["rules/kvlens-alerts.yml"]
    job, proxy = config["scrape_configs"]
    assert job["job_name"] == "vllm" and job.get("metrics_path", "/metrics") == "/metrics"
    # the PD proxy's own /metrics, from files of its own (targets/ lists vLLM instances only)
    assert proxy["job_name"] == "kvlens-pd-proxy"
    assert proxy["file_sd_configs"] == [{"files": ["pd-proxy-targets/*.json"]}]
    assert (PROM_DIR / "pd-proxy-targets" / "pd-proxy.json").read_text().strip() == "[]"


def test_the_alerts_the_issue_asks_for_exist_with_severity_and_summary():
    by_name = {r["alert"]: r for r in rules()}
    assert set(by_name) == {
        "KVLensStateLeakWhileIdle",
        "KVLensFailedLoads",
        "KVLensHitRateCollapse",
        "KVLensTierThrashing",
        "KVLensMetricsMissing",
        "KVLensNoMetrics",
        "VLLMTargetDown",
        "KVLensLoadedTokensDrift",
        "KVLensCacheCostsMoreThanItSaves",
        "KVLensPDTransfersRefused",
        "KVLensPDProxyWaitTimeouts",
        "KVLensPDBufferNearCapacity",
        "KVLensPDBufferLeak",
    }
    for r in by_name.values():
        assert r["labels"]["severity"] in ("warning", "critical")
        assert r["annotations"]["summary"] and r["annotations"]["description"]


def test_the_leak_alert_watches_every_leak_gauge():
    (leak,) = [r for r in rules() if r["alert"] == "KVLensStateLeakWhileIdle"]
    watched = set(re.findall(r'"gauge", "(\w+)"', leak["expr"]))
    assert watched == set(LEAK_GAUGES)
    assert {f"vllm:kvlens_{g}" for g in LEAK_GAUGES} <= metric_names(leak["expr"])


def test_rules_use_only_metrics_kvlens_or_vllm_export():
    """KVLens's and vLLM's, and the PD names the PD design fixes (engines' and proxy's)."""
    known = kvlens_sample_names() | VLLM_SAMPLE_NAMES | PD_SAMPLE_NAMES
    used = {n for r in rules() for n in metric_names(r["expr"])}
    assert used <= known, used - known
    proxy = {n for r in rules() for n in proxy_names(r["expr"])}
    assert proxy == {"kvlens_pd_proxy_wait_timeouts_total"}


def test_scaled_rules_for_live_tests_still_parse(tmp_path):
    from .prom import scale_durations

    scaled = scale_durations(RULES.read_text(), 60)
    assert "[5s]" in scaled and "offset 10s" in scaled and "for: 15s" in scaled and "[60s]" in scaled
    assert "[5m]" not in scaled and "for: 10m" not in scaled
    (tmp_path / "r.yml").write_text(scaled)
    out = subprocess.run(
        ["promtool", "check", "rules", str(tmp_path / "r.yml")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_drift_and_cost_rules_guard_their_divisions_and_absent_counters():
    by_name = {r["alert"]: r for r in rules()}
    drift = by_name["KVLensLoadedTokensDrift"]["expr"]
    assert "clamp_min(" in drift and "vllm:external_prefix_cache_hits_total" in drift
    cost = by_name["KVLensCacheCostsMoreThanItSaves"]["expr"]
    assert "vllm:kvlens_prefill_seconds_saved_total" in cost and "> 0.01" in cost
    assert by_name["KVLensCacheCostsMoreThanItSaves"]["for"] == "15m"
