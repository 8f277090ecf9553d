"""The dashboards against a live stack: a real ``vllm serve`` with KVLens (a CPU tier small
enough to evict, and a disk tier), a real Prometheus scraping it every second with the alert
rules at 1/60 of their durations, and a short workload with hits from both tiers, misses, a
skipped store, evictions and a failed load. Then every Grafana panel's query returns data,
every metric name exists, the alerts fire and resolve, and the Streamlit app works under
AppTest and in headless Chromium (whose screenshot is kept under .run/artifacts/)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from dashboard.catalog import VLLM_SAMPLE_NAMES, kvlens_sample_names
from grafana.panels import FAILED_LOADS_ANNOTATION, PANELS, with_selector
from tests.telemetry.serve import REPO, VllmServer, base_env, build_tiny_model, free_port, kv_transfer_config

from .prom import PrometheusServer, finite_values, scale_durations
from .promql import RULES, concrete, dashboard_exprs, metric_names, rule_exprs
from .serving import listening_addresses
from .workload import Background, Traffic

pytestmark = pytest.mark.integration

ARTIFACTS = REPO / ".run" / "artifacts"
KV_CONFIG = kv_transfer_config(
    chunk_size=256, max_local_cpu_size=0.002, local_disk="{tmp}/kv", max_local_disk_size=1
)
RATE_INTERVAL = "5m"  # covers the whole workload when the queries run


def tiny_model(tmp_path_factory) -> str:
    built = Path(os.environ.get("KVLENS_TINY_MODEL", REPO / ".run" / "tiny-model"))
    if (built / "model.safetensors").exists():
        return str(built)
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def scrape_configs(vllm: str, dead: str) -> list[dict]:
    return [
        # KVLens's vLLM, and a target where nothing listens (VLLMTargetDown).
        {"job_name": "vllm", "static_configs": [{"targets": [vllm, dead]}]},
        # The same vLLM seen without its KVLens series: what KVLensMetricsMissing is for.
        {
            "job_name": "vllm-without-kvlens",
            "static_configs": [{"targets": [vllm]}],
            "relabel_configs": [{"target_label": "instance", "replacement": "without-kvlens"}],
            "metric_relabel_configs": [
                {"source_labels": ["__name__"], "regex": "vllm:kvlens_.*", "action": "drop"}
            ],
        },
    ]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("live")
    kv = json.loads(json.dumps(KV_CONFIG).replace("{tmp}", str(tmp)))
    events = tmp / "events.jsonl"
    server = VllmServer(
        tiny_model(tmp_path_factory), kv, tmp / "serve.log", base_env(KVLENS_EVENT_LOG=str(events))
    )
    prom = None
    try:
        server.wait_ready()
        target, dead = f"127.0.0.1:{server.port}", f"127.0.0.1:{free_port()}"
        rules = tmp / "kvlens-alerts.yml"
        rules.write_text(scale_durations(RULES.read_text(), 60))
        (tmp / "prom").mkdir()
        prom = PrometheusServer(tmp / "prom", scrape_configs(target, dead), [rules])
        prom.wait_ready()
        prom.wait_for(lambda: prom.query(f'up{{instance="{target}"}} == 1'), 30, "the first scrape of vLLM")
        time.sleep(2)  # a baseline of every counter before traffic
        traffic = Traffic(server)
        start = time.time()
        traffic.hits(20)
        failed = traffic.failed_load(kv["kv_connector_extra_config"]["lmcache.local_disk"])
        failed_at = time.time()
        traffic.misses_until(lambda: prom.firing("KVLensHitRateCollapse"), timeout=60)
        idle_from = time.time()
        time.sleep(3)  # the last scrapes
        yield SimpleNamespace(
            server=server,
            prom=prom,
            traffic=traffic,
            target=target,
            dead=dead,
            events=events,
            failed=failed,
            start=start,
            failed_at=failed_at,
            idle_from=idle_from,
        )
    finally:
        if prom is not None:
            prom.stop()
        server.stop()


def query(live, expr: str) -> list[dict]:
    return live.prom.query(concrete(expr, rate_interval=RATE_INTERVAL, range_="10m"))


def panel(title: str):
    (p,) = [p for p in PANELS if p.title == title]
    return p


def values_by_legend(live, title: str) -> dict[str, float]:
    """The panel's series now, keyed by their legend with labels filled in."""
    out = {}
    for t in panel(title).targets:
        for series in query(live, with_selector(t.expr)):
            legend = t.legend
            for k, v in series["metric"].items():
                legend = legend.replace("{{" + k + "}}", v)
            out[legend or title] = float(series["value"][1])
    return out


def test_every_dashboard_panel_returns_data(live):
    empty = []
    for p in PANELS:
        if p.needs_remote:  # no Redis in this stack: tests/redis/test_serve_remote.py has its series
            continue
        for t in p.targets:
            if not finite_values(query(live, with_selector(t.expr))):
                empty.append(f"{p.row} / {p.title} / {t.legend or t.expr}")
    assert not empty, "panels without data:\n" + "\n".join(empty)
    annotation = concrete(with_selector(FAILED_LOADS_ANNOTATION.expr), interval="5s")
    assert finite_values(live.prom.query_range(annotation, live.start, time.time())), (
        "no failed-load annotation"
    )


def test_panels_show_what_the_workload_did(live):
    sources = values_by_legend(live, "Where prompt tokens came from")
    assert sources["KVLens cpu"] > 0 and sources["KVLens disk"] > 0 and sources["computed"] > 0
    assert {"not_stored", "partial_chunk"} <= set(values_by_legend(live, "Misses by reason"))
    assert "skip_save" in values_by_legend(live, "Stores skipped by reason")
    assert values_by_legend(live, "Requests with failed loads")["Requests with failed loads"] >= 1
    assert values_by_legend(live, "Evictions")["cpu"] > 0
    assert values_by_legend(live, "Tier fill")["cpu"] > 0.9
    assert values_by_legend(live, "Load latency")["p50"] > 0
    assert values_by_legend(live, "Prefill time saved (estimated)")["Prefill time saved (estimated)"] > 0
    assert values_by_legend(live, "Leaked state while idle")[live.target] == 0
    hit = values_by_legend(live, "Hit rate")
    assert 0.1 < hit["KVLens, tokens"] < 0.9 and 0.1 < hit["KVLens, requests"] < 0.9


def test_every_metric_name_is_one_kvlens_or_vllm_exports(live):
    exported = {name for name, _ in live.server.samples()}
    assert VLLM_SAMPLE_NAMES <= exported, VLLM_SAMPLE_NAMES - exported
    known = kvlens_sample_names() | exported | {"up"}
    used = {n for e in dashboard_exprs() + rule_exprs() for n in metric_names(e)}
    assert used <= known, used - known


@pytest.fixture
def app(monkeypatch, live):
    for var in ("KVLENS_DASHBOARD_METRICS", "KVLENS_DASHBOARD_PROMETHEUS", "KVLENS_EVENT_LOG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KVLENS_DASHBOARD_EVENTS", str(live.events))
    st.cache_resource.clear()
    yield AppTest.from_file(str(REPO / "dashboard" / "app.py"), default_timeout=60)
    st.cache_resource.clear()


def assert_clean(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def test_streamlit_app_on_the_live_endpoint_and_event_log(app, monkeypatch, live):
    monkeypatch.setenv("KVLENS_DASHBOARD_METRICS", live.target)
    app.run()
    time.sleep(1.1)
    app.run()
    assert_clean(app)
    metrics = {m.label: m.value for m in app.metric}
    assert metrics["Prompt tokens loaded by KVLens"] not in ("0", "–")
    assert metrics["Requests with failed loads"] == "1"
    (events,) = [d.value for d in app.dataframe if "request_id" in d.value.columns]
    (row,) = events[events["request_id"].str.startswith(live.failed["id"])].to_dict("records")
    assert (row["tier"], row["reason_kind"], row["blocks"], row["tokens recomputed"]) == (
        "disk",
        "corrupt",
        4,
        512,
    )
    assert app.get("vega_lite_chart")


def test_streamlit_app_on_prometheus(app, monkeypatch, live):
    monkeypatch.setenv("KVLENS_DASHBOARD_PROMETHEUS", live.prom.url)
    app.run()
    assert_clean(app)
    assert live.target in app.selectbox(key="instance").options
    assert len(app.get("vega_lite_chart")) >= 10  # history from Prometheus: rates at once
    metrics = {m.label: m.value for m in app.metric}
    assert metrics["Prompt tokens KVLens held"].endswith("%")


def test_alerts_fire_and_resolve_as_their_tests_say(live):
    time.sleep(max(0.0, live.idle_from + 22 - time.time()))  # idle longer than the leak alert's for:
    fired = {}
    for s in live.prom.query_range('ALERTS{alertstate="firing"}', live.start, time.time()):
        m = s["metric"]
        fired.setdefault(m["alertname"], set()).add(m.get("tier") or m.get("instance") or "")

    def now(name: str) -> set[str]:
        return {m.get("tier") or m.get("instance") or "" for m in live.prom.firing(name)}

    assert live.target in fired.get("KVLensFailedLoads", set()) and not now("KVLensFailedLoads")
    assert live.target in fired.get("KVLensHitRateCollapse", set())
    assert "cpu" in fired.get("KVLensTierThrashing", set()) and not now("KVLensTierThrashing")
    assert now("KVLensMetricsMissing") == {"without-kvlens"}
    assert now("VLLMTargetDown") == {live.dead}
    assert "KVLensStateLeakWhileIdle" not in fired and "KVLensNoMetrics" not in fired


def streamlit_server(live, port: int, log: Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        "dashboard/app.py",
        "--server.headless=true",
        f"--server.port={port}",  # no --server.address: the repository's config binds 127.0.0.1
        "--browser.gatherUsageStats=false",
        "--",
        "--metrics",
        live.target,
        "--events",
        str(live.events),
        "--refresh",
        "2",
    ]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)


def chromium(width: int = 1500, height: int = 1250):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument(f"--window-size={width},{height}")
    service = Service(shutil.which("chromedriver") or "/usr/bin/chromedriver")
    return webdriver.Chrome(service=service, options=options)


def wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise TimeoutError(f"{what} not seen within {timeout}s")


def test_app_in_headless_chromium(live, tmp_path):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    port = free_port()
    proc = streamlit_server(live, port, tmp_path / "streamlit.log")
    driver = None
    try:
        wait(lambda: _health(port), 60, "streamlit health")
        assert listening_addresses(port) == {"127.0.0.1"}
        driver = chromium()
        with Background(Traffic(live.server, seed=9000)) as traffic:
            driver.get(f"http://127.0.0.1:{port}")

            wait(lambda: charts_drawn(driver) >= 3, 90, "the overview charts")
            stamp = updated_stamp(driver)
            wait(lambda: updated_stamp(driver) not in ("", stamp), 20, "a refresh without reloading the page")
            time.sleep(8)  # a few more refreshes with traffic, for the picture
            assert_no_exception(driver)
            driver.save_screenshot(str(ARTIFACTS / "dashboard.png"))
        assert traffic.error is None, traffic.error
        names = tab_names(driver)
        assert names == [
            "Overview",
            "Hits and misses",
            "Latency and throughput",
            "Tiers and leaks",
            "Failures",
            "Requests",
            "Insights",
            "Tenants",
        ]
        for index, name in enumerate(names[1:], start=1):
            open_tab(driver, index)
            if name == "Requests":  # a table and a search box: the request log is off here
                time.sleep(1)
                assert_no_exception(driver)
                continue
            wait(lambda: charts_drawn(driver) >= 1, 30, f"a chart in {name}")
            time.sleep(1)
            assert_no_exception(driver)
            driver.save_screenshot(str(ARTIFACTS / f"dashboard-{name.lower().replace(' ', '-')}.png"))
        # Failures: the event timeline and the table of the failed load.
        wait(lambda: live.failed["id"] in driver.page_source, 20, "the failed request in the events table")
    finally:
        if driver is not None:
            driver.quit()
        proc.terminate()
        proc.wait(timeout=30)
    if os.environ.get("KVLENS_UPDATE_SCREENSHOT") == "1":
        shutil.copy(ARTIFACTS / "dashboard.png", REPO / "dashboard" / "screenshot.png")


def charts_drawn(driver) -> int:
    """Charts drawn in the open tab (only its panel is in the page)."""
    from selenium.webdriver.common.by import By

    drawn = '[data-testid="stTabPanel"] [data-testid="stVegaLiteChart"] :is(svg, canvas)'
    return len(driver.find_elements(By.CSS_SELECTOR, drawn))


# The app reruns every few seconds and Streamlit replaces elements as it does, so
# an element found by one WebDriver call can be gone by the next (stale). Text is
# read and tabs are clicked inside the page, in one script each.
_TABS = '[data-testid="stTabs"] [role="tab"]'


def updated_stamp(driver) -> str:
    return driver.execute_script(
        "const it = document.evaluate(\"//*[starts-with(normalize-space(text()), 'Updated ')]\","
        " document, null, XPathResult.FIRST_ORDERED_NODE_TYPE, null).singleNodeValue;"
        " return it ? it.innerText : '';"
    )


def tab_names(driver) -> list[str]:
    return driver.execute_script(
        f"return [...document.querySelectorAll('{_TABS}')].map(t => t.innerText.trim());"
    )


def open_tab(driver, index: int) -> None:
    driver.execute_script(f"document.querySelectorAll('{_TABS}')[{index}].click();")


def _health(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as r:
            return r.read().strip() == b"ok"
    except OSError:
        return False


def assert_no_exception(driver) -> None:
    from selenium.webdriver.common.by import By

    text = driver.execute_script("return document.body.innerText;")
    assert "Traceback" not in text and "could not be shown" not in text, text[:2000]
    assert not driver.find_elements(By.CSS_SELECTOR, '[data-testid="stException"]')
    assert not driver.find_elements(By.CSS_SELECTOR, '[data-testid="stAlertContentError"]'), text[:2000]
