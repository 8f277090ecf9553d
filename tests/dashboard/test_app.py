"""The Streamlit app under Streamlit's AppTest, on canned /metrics text captured from a real
vllm serve and on real event logs: every state it promises, and never an exception."""

from __future__ import annotations

import sys
import time
import types

import pytest
from streamlit.testing.v1 import AppTest

from .conftest import APP, DATA, write_events, write_requests


def texts(elements) -> list[str]:
    return [e.value for e in elements]


def charts(at: AppTest) -> list:
    return at.get("vega_lite_chart")


def page_text(at: AppTest) -> str:
    """Everything the page holds: every element's message to the browser, and every table."""
    from streamlit.testing.v1.element_tree import Block, Dataframe

    parts, stack = [], [at._tree]
    while stack:
        node = stack.pop()
        if isinstance(node, Block):
            stack.extend(node.children.values())
        if getattr(node, "proto", None) is not None:
            parts.append(str(node.proto))
        if isinstance(node, Dataframe):
            parts.append(node.value.to_string())
    return "\n".join(parts)


def opened(at: AppTest, tab: str) -> AppTest:
    """The app re-run with ``tab`` open (a person's click on it)."""
    at.session_state["section"] = tab
    return at.run()


def assert_clean(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not any("could not be shown" in t for t in texts(at.error)), texts(at.error)


def test_live_endpoint_charts_and_an_unreachable_one(
    app, monkeypatch, text_server, metrics_text, closed_port, tmp_path
):
    text_server.text = metrics_text
    monkeypatch.setenv("KVLENS_DASHBOARD_METRICS", f"{text_server.endpoint},127.0.0.1:{closed_port}")
    write_events(
        tmp_path / "events.jsonl",
        ("cmpl-a-0", "disk", 4, "corrupt: checksum"),
        ("cmpl-b-0", "cpu", 2, "missing: x"),
    )
    app.run()
    time.sleep(1.1)  # a second reading, so that rates exist
    app.run()
    assert_clean(app)
    assert any(
        t.startswith(f"Endpoint unreachable: http://127.0.0.1:{closed_port}/metrics")
        for t in texts(app.error)
    )
    assert [t.label for t in app.tabs] == [
        "Overview",
        "Hits and misses",
        "Latency and throughput",
        "Tiers and leaks",
        "Failures",
        "Requests",
        "Insights",
        "Tenants",
        "PD",
        "Blending",
    ]
    metrics = {m.label: m.value for m in app.metric}
    assert (
        metrics["Prompt tokens KVLens held"].endswith("%")
        and metrics["Prompt tokens loaded by KVLens"] != "–"
    )
    # This capture has no engine-measured prefill cost: unknown, not a guess from vLLM's
    # per-request prefill times (test_prefill_cost.py; with the measure: the insights test).
    assert metrics["Prefill time saved (estimated)"] == "–"
    assert len(charts(app)) >= 2
    # Only the open tab is computed: no other tab's table or chart is sent.
    assert not [d for d in app.dataframe if "request_id" in d.value.columns]
    assert "Failed blocks by reason" not in texts(app.subheader)
    opened(app, "Failures")
    assert_clean(app)
    assert "Failed blocks by reason" in texts(app.subheader) and not app.metric
    events_table = [d for d in app.dataframe if "request_id" in d.value.columns][0]
    assert sorted(events_table.value["request_id"]) == ["cmpl-a-0", "cmpl-b-0"]
    app.multiselect(key="ev_tier").select("disk").run()
    assert_clean(app)
    events_table = [d for d in app.dataframe if "request_id" in d.value.columns][0]
    assert list(events_table.value["request_id"]) == ["cmpl-a-0"]


def test_an_endpoint_without_kvlens_says_so(app, monkeypatch, text_server):
    text_server.text = (DATA / "metrics-no-kvlens.txt").read_text()
    monkeypatch.setenv("KVLENS_DASHBOARD_METRICS", text_server.endpoint)
    app.run()
    assert_clean(app)
    assert any(t.startswith("No KVLens metrics at this endpoint") for t in texts(app.warning))
    opened(app, "Failures")
    assert any(t.startswith("No events yet") for t in texts(app.info))


def test_a_failed_prometheus_query_says_so(app, monkeypatch, closed_port):
    monkeypatch.setenv("KVLENS_DASHBOARD_PROMETHEUS", f"http://127.0.0.1:{closed_port}")
    app.run()
    assert_clean(app)
    assert any(t.startswith("Prometheus query failed") for t in texts(app.error))


def test_nothing_running_at_the_default_endpoint_is_a_clear_state(app, monkeypatch, closed_port):
    monkeypatch.setenv("KVLENS_DASHBOARD_METRICS", f"127.0.0.1:{closed_port}")
    app.run()
    assert_clean(app)
    assert any(t.startswith("Endpoint unreachable") for t in texts(app.error))
    assert not charts(app)


def request_tables(at: AppTest) -> list[list[str]]:
    """The request ids of each table of requests on the page, in page order."""
    return [
        list(d.value["request_id"])
        for d in at.dataframe
        if "computed_tokens" in d.value.columns and "request_id" in d.value.columns
    ]


def test_the_requests_view_finds_a_request_and_lists_misses_by_reason(
    app, monkeypatch, closed_port, tmp_path
):
    monkeypatch.setenv("KVLENS_DASHBOARD_METRICS", f"127.0.0.1:{closed_port}")
    log = tmp_path / "requests.jsonl"
    monkeypatch.setenv("KVLENS_REQUEST_LOG", str(log))
    write_requests(
        log, ("cmpl-a-0", "evicted", 1.0), ("cmpl-b-0", "not_stored", 2.0), ("cmpl-c-0", None, 3.0)
    )
    with open(log, "ab") as f:
        f.write(b"garbage\n")
    app.run()
    opened(app, "Requests")
    assert_clean(app)
    assert any(t.startswith("Skipped 1 unreadable line") for t in texts(app.warning))
    assert request_tables(app) == [["cmpl-a-0"], ["cmpl-c-0", "cmpl-b-0", "cmpl-a-0"]]
    counts = [d.value for d in app.dataframe if "requests" in d.value.columns][0]
    assert dict(zip(counts["miss_reason"], counts["requests"], strict=True)) == {
        "evicted": 1,
        "not_stored": 1,
    }
    app.selectbox(key="rq_reason").select("not_stored").run()
    assert_clean(app)
    assert request_tables(app)[0] == ["cmpl-b-0"]
    app.text_input(key="rq_id").input("cmpl-a").run()
    assert_clean(app)
    assert any(
        t.startswith("cmpl-a-0: 1,000 prompt tokens") and "Missed: evicted" in t for t in texts(app.text)
    )
    app.text_input(key="rq_id").input("nope").run()
    assert any(t.startswith("No logged request matches 'nope'") for t in texts(app.info))


def test_the_requests_view_without_a_log_or_with_an_empty_one(app, monkeypatch, closed_port, tmp_path):
    monkeypatch.setenv("KVLENS_DASHBOARD_METRICS", f"127.0.0.1:{closed_port}")
    app.run()
    opened(app, "Requests")
    assert_clean(app)
    assert any(t.startswith("Request log not enabled: set KVLENS_REQUEST_LOG=") for t in texts(app.info))
    monkeypatch.setenv("KVLENS_REQUEST_LOG", str(tmp_path / "requests.jsonl"))
    fresh = AppTest.from_file(APP, default_timeout=60)
    fresh.run()
    opened(fresh, "Requests")
    assert_clean(fresh)
    assert any(t.startswith("No requests logged yet") for t in texts(fresh.info))


def test_the_insights_view_shows_sizing_advice_identity_and_time_saved(
    app, monkeypatch, text_server, metrics_text
):
    text_server.text = metrics_text + (DATA / "metrics-insights.txt").read_text()
    monkeypatch.setenv("KVLENS_DASHBOARD_METRICS", text_server.endpoint)
    fake = types.ModuleType("connector.engine.whatif")
    fake.sizing_advice = lambda curve, tier: f"advice for {tier} at {curve[1.0]:.0%}"
    monkeypatch.setitem(sys.modules, "connector.engine.whatif", fake)
    app.run()
    time.sleep(1.1)
    metrics = {m.label: m.value for m in app.run().metric}
    assert metrics["Prefill time saved (estimated)"] == "3.75 s"
    opened(app, "Insights")
    assert_clean(app)
    markdown = texts(app.markdown)
    assert "**cpu**: advice for cpu at 40%" in markdown and "**disk**: advice for disk at 60%" in markdown
    (identity,) = [d.value for d in app.dataframe if "key fingerprint" in d.value.columns]
    assert identity.loc[text_server.endpoint, "key fingerprint"] == "3f2a91c04b7e"
    assert bool(identity.loc[text_server.endpoint, "alone"])
    metrics = {m.label: m.value for m in app.metric}
    assert metrics["Prefill time saved"] == "3.75 s"
    assert metrics["Prefill cost per token"] == "0.2 ms"
    opened(app, "Hits and misses")  # what each miss reason means, the newer ones included
    assert any("other_namespace" in t and "load_failed" in t for t in texts(app.markdown))


def test_the_insights_view_without_the_new_series_or_the_advice_module(
    app, monkeypatch, text_server, metrics_text
):
    text_server.text = metrics_text
    monkeypatch.setenv("KVLENS_DASHBOARD_METRICS", text_server.endpoint)
    monkeypatch.setitem(sys.modules, "connector.engine.whatif", None)
    app.run()
    opened(app, "Insights")
    assert_clean(app)
    assert any(t.startswith("No what-if estimate yet") for t in texts(app.info))
    assert any(t.startswith("No instance reports vllm:kvlens_info") for t in texts(app.info))
    assert {m.label: m.value for m in app.metric}["Prefill time saved"] == "–"


SECRET = "kvlens-canary root:x:0:0:root:/root:/bin/bash"


def test_without_the_flag_the_sidebar_shows_the_sources_but_cannot_change_them(
    app, monkeypatch, closed_port, tmp_path
):
    monkeypatch.setenv("KVLENS_DASHBOARD_METRICS", f"127.0.0.1:{closed_port}")
    monkeypatch.setenv("KVLENS_DASHBOARD_REQUESTS", str(tmp_path / "requests.jsonl"))
    app.run()
    assert_clean(app)
    assert not app.sidebar.text_area and not app.sidebar.text_input
    sidebar = page_text(app)
    assert f"127.0.0.1:{closed_port}" in sidebar and "--allow-source-edits" in sidebar


@pytest.fixture
def file_reads(monkeypatch) -> list[str]:
    """Every URL urllib's file handler is asked to open (it opens nothing here)."""
    import urllib.error
    import urllib.request

    opened: list[str] = []

    def refuse(handler, request):
        opened.append(request.full_url)
        raise urllib.error.URLError("file reads are off in this test")

    monkeypatch.setattr(urllib.request.FileHandler, "file_open", refuse)
    return opened


def test_with_the_flag_an_edited_file_url_is_refused_and_never_read(
    app, monkeypatch, text_server, metrics_text, tmp_path, file_reads
):
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    text_server.text = metrics_text
    monkeypatch.setattr(sys, "argv", [APP, "--allow-source-edits"])
    monkeypatch.setenv("KVLENS_DASHBOARD_METRICS", text_server.endpoint)
    app.run()
    assert_clean(app)
    for url in (f"file://{secret}", "file:///etc/passwd"):
        app.sidebar.text_area[0].input(url).run()
        assert not app.exception
        assert any(t.startswith(f"Refused {url}") and "http" in t for t in texts(app.sidebar.error))
        page = page_text(app)
        assert "canary" not in page and "root:x:0:0" not in page
    assert not file_reads
    app.sidebar.text_area[0].input(f"http://{text_server.endpoint}/metrics").run()
    assert_clean(app)
    assert not app.sidebar.error and app.get("vega_lite_chart") is not None


def test_a_file_url_given_at_start_up_stops_the_app_with_the_variable_named(app, monkeypatch, file_reads):
    monkeypatch.setenv("KVLENS_DASHBOARD_METRICS", "file:///etc/passwd")
    app.run()
    assert not app.exception and not file_reads
    assert texts(app.error) == [
        "Not started: KVLENS_DASHBOARD_METRICS file:///etc/passwd: only http:// and https:// URLs are read."
    ]
    assert "root:x:0:0" not in page_text(app)


def test_a_part_of_the_page_that_fails_names_the_error_class_only(
    app, monkeypatch, text_server, metrics_text
):
    from dashboard import overview

    def fails(frame):
        raise ValueError(SECRET)

    text_server.text = metrics_text
    monkeypatch.setenv("KVLENS_DASHBOARD_METRICS", text_server.endpoint)
    monkeypatch.setattr(overview, "savings", fails)
    app.run()
    assert not app.exception
    assert "Overview could not be shown: ValueError" in texts(app.error)
    assert "canary" not in page_text(app)


def test_served_on_every_interface_by_default_it_shows_nothing_but_how_to_fix_it(
    app, monkeypatch, text_server, metrics_text
):
    from streamlit import config

    text_server.text = metrics_text
    monkeypatch.setenv("KVLENS_DASHBOARD_METRICS", text_server.endpoint)
    monkeypatch.setattr(sys, "argv", [APP])  # what `streamlit run dashboard/app.py` leaves
    real = config.get_option
    monkeypatch.setattr(config, "get_option", lambda k: None if k == "server.address" else real(k))
    monkeypatch.setattr(config, "get_where_defined", lambda k: "<default>")
    app.run()
    assert not app.exception
    (error,) = texts(app.error)
    assert error.startswith("This app is listening on every network interface")
    assert "--server.address 127.0.0.1" in error and ".streamlit/config.toml" in error
    assert not app.tabs and not app.sidebar.radio and not app.metric


def test_the_tenants_view_shows_each_tenant_by_its_id(app, monkeypatch, text_server, metrics_text):
    text_server.text = metrics_text + (DATA / "metrics-tenants.txt").read_text()
    monkeypatch.setenv("KVLENS_DASHBOARD_METRICS", text_server.endpoint)
    app.run()
    time.sleep(1.1)
    opened(app, "Tenants")
    assert_clean(app)
    (table,) = [d.value for d in app.dataframe if "hit ratio" in d.value.columns]
    assert set(table.index) == {"default", "other", "salt:a575499155", "salt:bd9603f407", "user:c0147d233c"}
    assert table.loc["salt:a575499155", "held (tokens)"] == 1152
    assert table.loc["salt:a575499155", "looked up (tokens)"] == 2600
    assert table.loc["default", "loaded (tokens)"] == 640
    assert table.loc["user:c0147d233c", "bytes held (cpu)"] == 2359296
    assert "Bytes held per tenant and tier" in texts(app.subheader)


def test_the_tenants_view_without_tenant_series_says_so(app, monkeypatch, text_server, metrics_text):
    text_server.text = metrics_text
    monkeypatch.setenv("KVLENS_DASHBOARD_METRICS", text_server.endpoint)
    app.run()
    opened(app, "Tenants")
    assert_clean(app)
    assert any(t.startswith("No per-tenant series yet") for t in texts(app.info))


def test_an_unknown_ratio_reads_as_a_dash_never_none(app, monkeypatch, text_server, metrics_text):
    """An instance that looked nothing up has no hit rate: the metric, and every table cell that
    holds a missing value, read "–" (a table shows its placeholder for missing values)."""
    import re

    nothing = re.sub(
        r"^(vllm:kvlens_(lookup|hit)_tokens_total\{.*\}) [0-9.e+]+$", r"\1 0.0", metrics_text, flags=re.M
    )
    text_server.text = nothing
    monkeypatch.setenv("KVLENS_DASHBOARD_METRICS", text_server.endpoint)
    app.run()
    assert_clean(app)
    assert {m.label: m.value for m in app.metric}["Prompt tokens KVLens held"] == "–"
    (per_instance,) = [d for d in app.dataframe if "KVLens hit rate" in d.value.columns]
    assert per_instance.value["KVLens hit rate"].isna().all()
    tables = list(app.dataframe)
    for tab in ("Tiers and leaks", "Insights", "Failures"):
        tables += list(opened(app, tab).dataframe)
        assert_clean(app)
    assert len(tables) >= 2
    assert [t.proto.placeholder for t in tables] == ["–"] * len(tables)
