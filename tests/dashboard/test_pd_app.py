"""The app's PD tab under Streamlit's AppTest: a prefiller, a decoder and a PD proxy serving
the canned PD series and request records of tests/dashboard/data."""

from __future__ import annotations

import json

import pytest

from dashboard import palette, pd_records

from .conftest import DATA, TextServer
from .test_app import assert_clean, opened, texts


@pytest.fixture
def pd_servers():
    prefiller = TextServer((DATA / "metrics-pd-prefiller.txt").read_text())
    decoder = TextServer((DATA / "metrics-pd-decoder.txt").read_text())
    proxy = TextServer()
    proxy.paths["/metrics"] = (DATA / "metrics-pd-proxy.txt").read_text()
    proxy.paths[pd_records.PATH] = (DATA / "pd-requests.json").read_text()
    yield prefiller, decoder, proxy
    for s in (prefiller, decoder, proxy):
        s.close()


def phase_colours(at) -> list[dict[str, str]]:
    """Phase -> colour of every chart on the page that colours by phase."""
    out = []
    for c in at.get("vega_lite_chart"):
        spec = json.loads(c.proto.spec)
        colour = spec.get("encoding", {}).get("color", {})
        if colour.get("field") == "phase":
            out.append(dict(zip(colour["scale"]["domain"], colour["scale"]["range"], strict=True)))
    return out


def test_the_pd_tab_splits_ttft_per_pair_and_for_a_chosen_request(app, monkeypatch, pd_servers):
    prefiller, decoder, proxy = pd_servers
    monkeypatch.setenv("KVLENS_DASHBOARD_METRICS", f"{prefiller.endpoint},{decoder.endpoint}")
    monkeypatch.setenv("KVLENS_DASHBOARD_PD_PROXY", proxy.endpoint)
    app.run()
    assert "PD" in [t.label for t in app.tabs]
    assert not [p for p in proxy.asked if p.startswith(pd_records.PATH)]  # read only when shown
    opened(app, "PD")
    assert_clean(app)
    (means,) = [d.value for d in app.dataframe if "prefill (ms)" in d.value.columns]
    main = "127.0.0.1:8100 → 127.0.0.1:8200"
    assert means.loc[main, "prefill (ms)"] == pytest.approx(500)
    assert means.loc[main, "transfer wait (ms)"] == pytest.approx(50)
    assert means.loc[main, "decode first token (ms)"] == pytest.approx(100)
    assert means.loc[main, "requests"] == 4
    app.radio(key="pd_group").set_value("decoder").run()
    assert_clean(app)
    (means,) = [d.value for d in app.dataframe if "prefill (ms)" in d.value.columns]
    assert list(means.index) == ["127.0.0.1:8200", "127.0.0.1:8300"]
    # the newest request is chosen first; another one's split is one bar in the phases' colours
    assert any(
        t.startswith("pd-3: time to first token 1,200.0 ms = prefill 800.0 ms") for t in texts(app.text)
    )
    app.selectbox(key="pd_request").select("pd-2").run()
    assert_clean(app)
    assert any(
        t.startswith(
            "pd-2: time to first token 640.0 ms = prefill 500.0 ms; transfer wait 40.0 ms; "
            "decode first token 100.0 ms; decoder loaded"
        )
        for t in texts(app.text)
    )
    coloured = phase_colours(app)
    assert len(coloured) == 2  # the pairs' bars and the request's bar
    for chart in coloured:
        assert chart == {name: palette.PHASES[name] for name in chart}
    (buffers,) = [d.value for d in app.dataframe if "capacity_bytes" in d.value.columns]
    assert buffers.loc[decoder.endpoint, "fill"] == pytest.approx(0.25)
    assert buffers.loc[decoder.endpoint, "entries"] == 2
    (refused,) = [d.value for d in app.dataframe if "transfers" in d.value.columns]
    keys = zip(refused["where"], refused["reason"], strict=True)
    assert dict(zip(keys, refused["transfers"], strict=True)) == {
        ("engines, send", "buffer_full"): 1,
        ("engines, send", "mismatch:tp_size"): 1,  # the mismatching fields named
        ("engines, receive", "buffer_full"): 1,
        ("engines, receive", "expired"): 2,
        ("proxy", "wait timeout 127.0.0.1:8100 → 127.0.0.1:8300"): 1,
    }
    (records,) = [d.value for d in app.dataframe if "req_id" in d.value.columns]
    assert list(records["req_id"]) == ["pd-3", "pd-2", "pd-1"]
    assert [t.proto.placeholder for t in app.dataframe] == ["–"] * len(app.dataframe)


def test_without_pd_the_tab_says_how_to_get_it(app, monkeypatch, text_server, metrics_text):
    text_server.text = metrics_text
    monkeypatch.setenv("KVLENS_DASHBOARD_METRICS", text_server.endpoint)
    app.run()
    opened(app, "PD")
    assert_clean(app)
    assert any(t.startswith("No PD series yet") and "--pd-proxy" in t for t in texts(app.info))


def test_an_unreachable_or_wrong_proxy_is_named(app, monkeypatch, pd_servers, closed_port, text_server):
    prefiller, decoder, _ = pd_servers
    monkeypatch.setenv("KVLENS_DASHBOARD_METRICS", f"{prefiller.endpoint},{decoder.endpoint}")
    monkeypatch.setenv("KVLENS_DASHBOARD_PD_PROXY", f"127.0.0.1:{closed_port}")
    app.run()
    opened(app, "PD")
    assert_clean(app)
    assert any(
        t.startswith(f"PD proxy unreachable: http://127.0.0.1:{closed_port}/metrics")
        for t in texts(app.error)
    )
    assert any(t.startswith("No PD request timed by the proxy yet") for t in texts(app.info))
    assert any(t.startswith("Receive buffer") for t in texts(app.subheader))


def test_a_proxy_url_that_is_not_http_stops_the_app(app, monkeypatch):
    monkeypatch.setenv("KVLENS_DASHBOARD_PD_PROXY", "file:///etc/passwd")
    app.run()
    assert texts(app.error) == [
        "Not started: KVLENS_DASHBOARD_PD_PROXY file:///etc/passwd: only http:// and https:// URLs are read."
    ]
