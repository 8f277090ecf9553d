"""The dashboards against a live stack: a real ``vllm serve`` with KVLens (a CPU tier small
enough to evict, and a disk tier), a real Prometheus scraping it every second with the alert
rules at 1/60 of their durations, and a short workload with hits from both tiers, misses, a
skipped store, evictions and a failed load. Then every Grafana panel's query returns data,
every metric name exists, the alerts fire and resolve, and the Streamlit app works under
AppTest and in headless Chromium: one colour per source and tier in every chart, and a page
that stays readable while it refreshes (screenshots, colours and the share of time the page
was greyed out are kept under .run/artifacts/)."""

from __future__ import annotations

import json
import os
import shutil
import time
from types import SimpleNamespace

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from dashboard import palette
from dashboard.catalog import PD_HISTOGRAM_BUCKETS, PD_SAMPLE_NAMES, VLLM_SAMPLE_NAMES, kvlens_sample_names
from grafana.panels import FAILED_LOADS_ANNOTATION, PANELS, with_selector
from tests.telemetry.serve import (
    REPO,
    VllmServer,
    base_env,
    free_port,
    kv_transfer_config,
    wait_until,
)

from .browser import (
    assert_no_exception,
    charts_drawn,
    chromium,
    healthy,
    legend_colours,
    panel_html,
    show_tab,
    staleness,
    streamlit_server,
    tab_names,
    times_tabs_disabled,
    updated_stamp,
    wait_for,
    wait_for_refreshes,
    watch_tabs,
)
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
def live(tmp_path_factory, tiny_model):
    tmp = tmp_path_factory.mktemp("live")
    kv = json.loads(json.dumps(KV_CONFIG).replace("{tmp}", str(tmp)))
    events = tmp / "events.jsonl"
    server = VllmServer(tiny_model, kv, tmp / "serve.log", base_env(KVLENS_EVENT_LOG=str(events)))
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
        if p.needs_pd:  # no PD engines or proxy here: test_grafana_dashboard.py evaluates the split
            continue
        if p.needs_blend:  # no blending here: tests/blend/test_blend_flow.py has its series
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
    known = kvlens_sample_names() | exported | {"up"} | PD_SAMPLE_NAMES | PD_HISTOGRAM_BUCKETS  # PD: not here
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
    assert app.get("vega_lite_chart")
    app.session_state["section"] = "Failures"  # only the open tab is computed
    app.run()
    assert_clean(app)
    (events,) = [d.value for d in app.dataframe if "request_id" in d.value.columns]
    (row,) = events[events["request_id"].str.startswith(live.failed["id"])].to_dict("records")
    assert (row["tier"], row["reason_kind"], row["blocks"], row["tokens recomputed"]) == (
        "disk",
        "corrupt",
        4,
        512,
    )


def test_streamlit_app_on_prometheus(app, monkeypatch, live):
    monkeypatch.setenv("KVLENS_DASHBOARD_PROMETHEUS", live.prom.url)
    app.run()
    assert_clean(app)
    assert live.target in app.selectbox(key="instance").options
    metrics = {m.label: m.value for m in app.metric}
    assert metrics["Prompt tokens KVLens held"].endswith("%")
    drawn = len(app.get("vega_lite_chart"))
    for tab in ("Hits and misses", "Latency and throughput", "Tiers and leaks"):  # one at a time
        app.session_state["section"] = tab
        app.run()
        assert_clean(app)
        drawn += len(app.get("vega_lite_chart"))
    assert drawn >= 10  # history from Prometheus: rates at once


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


def test_app_in_headless_chromium(live, tmp_path):
    """The app as a person sees it, with traffic: it refreshes without reloading, stays
    readable while it does (sampled for 30 s: the share of the page greyed out as stale), gives
    each source and tier one colour in every chart of every tab, and every tab draws. A click on
    a tab lands at once and its panel shows within a few refreshes (bounded by refreshes, not
    seconds: the machine's load makes this slower, never failing)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    port = free_port()
    args = ("--metrics", live.target, "--events", str(live.events), "--refresh", str(REFRESH_S))
    proc = streamlit_server(port, tmp_path / "streamlit.log", *args)
    driver = None
    try:
        wait_until(lambda: healthy(port), 60, what="streamlit health")
        assert listening_addresses(port) == {"127.0.0.1"}
        driver = chromium()
        with Background(Traffic(live.server, seed=9000)) as traffic:
            driver.get(f"http://127.0.0.1:{port}")
            wait_until(lambda: updated_stamp(driver), 120, 0.5, "the first refresh")  # start-up
            wait_for(driver, lambda: charts_drawn(driver) >= 2, "the overview charts")
            wait_for_refreshes(driver)  # a refresh without reloading the page
            watch_tabs(driver)
            stale = staleness(driver, seconds=STALE_SAMPLE_S)
            (ARTIFACTS / "dashboard-staleness.txt").write_text(f"refresh every {REFRESH_S} s: {stale}\n")
            print(f"\nstaleness, refresh every {REFRESH_S} s: {stale}")
            assert_no_exception(driver)
            driver.save_screenshot(str(ARTIFACTS / "dashboard.png"))
            colours = wait_for(driver, lambda: legend_colours(driver, "Overview"), "the overview's legends")
        assert traffic.error is None, traffic.error
        # Greyed out, as a person sees it: under a tenth of the page, averaged over the sample.
        assert stale.faded_share < 0.10, str(stale)
        assert times_tabs_disabled(driver, reset=True) == 0  # refreshes alone, over the sample
        assert tab_names(driver) == list(TAB_SHOWS)
        disabled_by_refreshes = 0
        for name, shows in list(TAB_SHOWS.items())[1:]:
            show_tab(driver, name, shows)
            times_tabs_disabled(driver, reset=True)  # the click's own rerun sent the tabs again
            if name in ("Requests", "PD", "Blending"):  # no request log, PD or blending here
                wait_for_refreshes(driver)
                disabled_by_refreshes += times_tabs_disabled(driver)
                assert_no_exception(driver)
                continue
            wait_for(driver, lambda: charts_drawn(driver) >= 1, f"a chart in {name}")
            if name == "Failures":  # the event timeline and the table of the failed load
                wait_for(driver, lambda: live.failed["id"] in panel_html(driver), "the failed request")
            if name not in ("Failures", "Tenants"):  # one series each: no legend to read
                legends = wait_for(driver, lambda n=name: legend_colours(driver, n), f"the legends in {name}")
                colours += legends
            times_tabs_disabled(driver, reset=True)  # waiting for the content was no click
            wait_for_refreshes(driver)
            disabled_by_refreshes += times_tabs_disabled(driver)
            assert_no_exception(driver)
            driver.save_screenshot(str(ARTIFACTS / f"dashboard-{name.lower().replace(' ', '-')}.png"))
        assert disabled_by_refreshes == 0  # a refresh never disabled a tab (a click would be lost)
    finally:
        if driver is not None:
            driver.quit()
        proc.terminate()
        proc.wait(timeout=30)
    assert_one_colour_per_source(colours)
    if os.environ.get("KVLENS_UPDATE_SCREENSHOT") == "1":
        shutil.copy(ARTIFACTS / "dashboard.png", REPO / "dashboard" / "screenshot.png")


# Each tab, and what its panel says once it is drawn on this stack.
TAB_SHOWS = {
    "Overview": "Where prompt tokens came from",
    "Hits and misses": "Misses by reason",
    "Latency and throughput": "Lookup latency",
    "Tiers and leaks": "Tiers: used of capacity",
    "Failures": "Failed blocks by reason",
    "Requests": "Request log not enabled",
    "Insights": "Tier sizing",
    "Tenants": "tenant",
    "PD": "No PD series yet",
    "Blending": "No blended requests yet",
}
REFRESH_S = 2  # a refresh every 2 s: more refreshes, and less time between them, than the default 5
STALE_SAMPLE_S = 30.0


def assert_one_colour_per_source(colours: list[tuple[str, str, str]]) -> None:
    """Each series drawn in the colour the palette gives its name, and each source and tier in
    one colour across the charts that draw it plainly ("cpu", "KVLens cpu", "saved, cpu")."""
    (ARTIFACTS / "dashboard-colours.json").write_text(json.dumps(colours, indent=1))
    wrong = [(chart, name, drawn) for chart, name, drawn in colours if drawn != palette.colour(name)]
    assert not wrong, f"drawn in another colour than the palette's: {wrong}"
    plain: dict[str, set[str]] = {}
    charts_of: dict[str, set[str]] = {}
    for chart, name, drawn in colours:
        key = plain_source(name)
        if key is not None:
            plain.setdefault(key, set()).add(drawn)
            charts_of.setdefault(key, set()).add(chart)
    assert {k: len(v) for k, v in plain.items()} == dict.fromkeys(plain, 1), plain
    # not vacuous: the CPU and disk tiers and vLLM's prefix cache are each drawn in several charts
    assert all(len(charts_of.get(k, ())) >= 2 for k in ("cpu", "disk", "vLLM prefix cache")), charts_of


def plain_source(name: str) -> str | None:
    """The source or tier a series name names plainly ("KVLens cpu", "saved, disk", "vLLM prefix
    cache, tokens"), or None for a variant ("load cpu", "KVLens, requests") or anything else."""
    words = name.replace(",", " ").split()
    tiers = [w for w in words if w in palette.TIERS]
    if len(tiers) == 1 and set(words) - {tiers[0]} <= {"KVLens", "saved"}:
        return tiers[0]
    source = name.removesuffix(", tokens")
    return source if source in palette.SOURCES else None
