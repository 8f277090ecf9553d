"""The Streamlit app under Streamlit's AppTest, on canned /metrics text captured from a real
vllm serve and on real event logs: every state it promises, and never an exception."""

from __future__ import annotations

import time

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from .conftest import DATA, write_events
from .promql import REPO

APP = str(REPO / "dashboard" / "app.py")


@pytest.fixture
def app(monkeypatch, tmp_path):
    """A fresh AppTest with the dashboard's environment cleared (set it, then ``.run()``)."""
    for var in (
        "KVLENS_DASHBOARD_METRICS",
        "KVLENS_DASHBOARD_PROMETHEUS",
        "KVLENS_DASHBOARD_EVENTS",
        "KVLENS_EVENT_LOG",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KVLENS_DASHBOARD_EVENTS", str(tmp_path / "events.jsonl"))
    st.cache_resource.clear()
    yield AppTest.from_file(APP, default_timeout=60)
    st.cache_resource.clear()


def texts(elements) -> list[str]:
    return [e.value for e in elements]


def charts(at: AppTest) -> list:
    return at.get("vega_lite_chart")


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
    ]
    metrics = {m.label: m.value for m in app.metric}
    assert (
        metrics["Prompt tokens KVLens held"].endswith("%")
        and metrics["Prompt tokens loaded by KVLens"] != "–"
    )
    assert metrics["Prefill time saved (estimated)"] != "–"
    assert len(charts(app)) >= 8
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
