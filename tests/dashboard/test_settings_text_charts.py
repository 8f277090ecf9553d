"""Flags and environment, status messages and number formats, and the charts' units."""

from __future__ import annotations

import pandas as pd
import pytest

from dashboard import charts, settings, sources, text
from telemetry.settings import default_event_log


def test_defaults_read_the_demo_server_and_the_default_event_log():
    s = settings.parse([], {})
    assert s.source == settings.METRICS and s.endpoints == ("127.0.0.1:8000",)
    assert s.events == (default_event_log(),) and s.refresh_s == 5.0


def test_flags_win_over_environment():
    env = {
        "KVLENS_DASHBOARD_METRICS": "a:1,b:2",
        "KVLENS_EVENT_LOG": "/x.jsonl",
        "KVLENS_DASHBOARD_REFRESH_S": "2",
    }
    assert settings.parse([], env).endpoints == ("a:1", "b:2")
    assert settings.parse([], env).events == ("/x.jsonl",) and settings.parse([], env).refresh_s == 2
    s = settings.parse(
        ["--metrics", "c:3", "--events", "/y", "--events", "/z", "--refresh", "7", "--other"], env
    )
    assert s.endpoints == ("c:3",) and s.events == ("/y", "/z") and s.refresh_s == 7


def test_prometheus_alone_selects_prometheus():
    s = settings.parse(["--prometheus", "http://p:9090"], {})
    assert s.source == settings.PROMETHEUS and s.prometheus == "http://p:9090"
    assert (
        settings.parse(
            [], {"KVLENS_DASHBOARD_PROMETHEUS": "http://p:9090", "KVLENS_DASHBOARD_REFRESH_S": "x"}
        ).refresh_s
        == 5
    )


def test_status_messages_name_the_state():
    assert text.status_message(sources.Status("u", sources.OK)) is None
    level, msg = text.status_message(sources.Status("http://h/metrics", sources.UNREACHABLE, "refused"))
    assert level == text.ERROR and msg.startswith("Endpoint unreachable: http://h/metrics")
    assert (
        "No KVLens metrics at this endpoint" in text.status_message(sources.Status("u", sources.NO_KVLENS))[1]
    )
    assert "Prometheus query failed" in text.status_message(sources.Status("u", sources.QUERY_FAILED))[1]


def test_numbers():
    assert text.number(1234567) == "1.23M" and text.number(12) == "12" and text.number(None) == "–"
    assert (
        text.seconds(0.0123) == "12.3 ms" and text.seconds(90) == "90 s" and text.percent(0.4271) == "42.7%"
    )


def test_line_chart_names_its_unit_and_scales_values():
    wide = pd.DataFrame({"load": [0.002, 0.004]}, index=[100.0, 110.0])
    spec = charts.line(wide, charts.MS).to_dict()
    assert spec["encoding"]["y"]["title"] == "ms"
    values = [r["value"] for r in spec["datasets"][next(iter(spec["datasets"]))]]
    assert values == [2.0, 4.0]


def test_to_long_drops_missing_points():
    wide = pd.DataFrame({"a": [1.0, None], "b": [None, 2.0]}, index=[0.0, 10.0])
    long = charts.to_long(wide)
    assert list(long["series"]) == ["a", "b"] and str(long["time"].dt.tz) == "UTC"


def test_tier_fill_puts_tiers_of_any_size_on_one_percent_scale():
    from dashboard import views

    from .frames import frame, row

    f = frame(
        row(0, "vllm:kvlens_tier_used_bytes", 2e6, tier="cpu"),
        row(0, "vllm:kvlens_tier_capacity_bytes", 2e6, tier="cpu"),
        row(0, "vllm:kvlens_tier_used_bytes", 1e8, tier="disk"),
        row(0, "vllm:kvlens_tier_capacity_bytes", 1e9, tier="disk"),
    )
    spec = charts.tier_fill(views.tier_table(f)).to_dict()
    rows = {r["tier"]: r for r in spec["datasets"][next(iter(spec["datasets"]))]}
    assert rows["cpu"]["fill"] == 1.0 and rows["disk"]["fill"] == 0.1 and rows["disk"]["capacity"] == 1000


def test_request_logs_come_from_flags_then_the_servers_variable_and_are_off_by_default():
    assert settings.parse([], {}).requests == ()
    assert settings.parse([], {"KVLENS_REQUEST_LOG": "/r.jsonl"}).requests == ("/r.jsonl",)
    assert settings.parse([], {"KVLENS_REQUEST_LOG": "off"}).requests == ()
    env = {"KVLENS_DASHBOARD_REQUESTS": "/a,/b", "KVLENS_REQUEST_LOG": "/r.jsonl"}
    assert settings.parse([], env).requests == ("/a", "/b")
    assert settings.parse(["--requests", "/c"], env).requests == ("/c",)


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        (["--metrics", "file:///etc/passwd"], {}, "--metrics"),
        (["--metrics", "127.0.0.1:8000,ftp://h/metrics"], {}, "--metrics"),
        ([], {"KVLENS_DASHBOARD_METRICS": "file:///etc/passwd"}, "KVLENS_DASHBOARD_METRICS"),
        (["--prometheus", "file:///etc/passwd"], {}, "--prometheus"),
        ([], {"KVLENS_DASHBOARD_PROMETHEUS": "data:text/plain,x"}, "KVLENS_DASHBOARD_PROMETHEUS"),
    ],
)
def test_a_source_that_is_not_an_http_url_is_refused_at_start_up(argv, env, named):
    with pytest.raises(ValueError, match=named):
        settings.parse(argv, env)


def test_source_edits_are_off_unless_the_app_is_started_with_the_flag():
    assert not settings.parse([], {}).allow_source_edits
    assert not settings.parse([], {"KVLENS_DASHBOARD_ALLOW_SOURCE_EDITS": "1"}).allow_source_edits
    assert settings.parse(["--allow-source-edits"], {}).allow_source_edits


def test_edited_endpoints_keep_the_http_ones_and_name_the_refused():
    kept, refused = settings.checked_endpoints(
        ["127.0.0.1:1", "file:///etc/passwd", "https://h/m", "ftp://x/"]
    )
    assert kept == ("127.0.0.1:1", "https://h/m") and refused == ("file:///etc/passwd", "ftp://x/")


@pytest.mark.parametrize(
    ("address", "where", "exposed"),
    [
        (None, "<default>", True),  # Streamlit's default: every interface
        ("", "<default>", True),
        ("127.0.0.1", "/repo/.streamlit/config.toml", False),
        ("0.0.0.0", "command-line argument or environment variable", False),  # told otherwise
        ("", "command-line argument or environment variable", False),
    ],
)
def test_the_app_refuses_to_serve_every_interface_unless_told_to(address, where, exposed):
    assert settings.listens_everywhere_by_default(address, where) is exposed
