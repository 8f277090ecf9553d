"""The app on a PD pair under Streamlit's AppTest: a prefiller, a decoder and a PD proxy serving
the canned PD series and request records of tests/dashboard/data. The Overview counts what the
decoder received from the prefiller as a source of its own; the PD tab splits time to first
token over one set of requests, lists only decoders' buffers and names each engine's role."""

from __future__ import annotations

import json
import time

import pytest

from dashboard import overview, palette, pd_records, text

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


def chart_colours(at, field: str) -> list[dict[str, str]]:
    """Series -> colour of every chart on the page that colours by ``field``."""
    out = []
    for c in at.get("vega_lite_chart"):
        spec = json.loads(c.proto.spec)
        colour = spec.get("encoding", {}).get("color", {})
        if colour.get("field") == field:
            out.append(dict(zip(colour["scale"]["domain"], colour["scale"]["range"], strict=True)))
    return out


def phase_colours(at) -> list[dict[str, str]]:
    return chart_colours(at, "phase")


def test_the_overview_counts_what_the_decoder_received_as_a_source_of_its_own(app, monkeypatch, pd_servers):
    prefiller, decoder, _ = pd_servers
    monkeypatch.setenv("KVLENS_DASHBOARD_METRICS", f"{prefiller.endpoint},{decoder.endpoint}")
    app.run()
    time.sleep(1.1)  # a second reading, so that rates exist
    app.run()
    assert_clean(app)
    metrics = {m.label: m for m in app.metric}
    loaded = metrics["Prompt tokens loaded by KVLens"]
    assert loaded.value == "6k"  # the decoder's 3 prompts of 2000 tokens, received from the prefiller
    assert loaded.proto.help.startswith("0 loaded from KVLens's tiers and 6k received from a prefiller (PD)")
    assert metrics["Prompt tokens KVLens held"].value == text.percent(6000 / 16003)  # both engines' lookups
    assert text.PD_SOURCE in metrics["Prompt tokens KVLens held"].proto.help
    (instances,) = [d.value for d in app.dataframe if "KVLens hit rate" in d.value.columns]
    assert instances.loc[prefiller.endpoint, "PD role"] == "prefiller"
    assert instances.loc[decoder.endpoint, "PD role"] == "decoder"
    assert instances.loc[decoder.endpoint, overview.RECEIVED_COLUMN] == 6000
    assert instances.loc[decoder.endpoint, "KVLens hit rate"] == pytest.approx(6000 / 6003)
    sources = [c for c in chart_colours(app, "series") if palette.PD_RECEIVED in c]
    assert sources and all(c[palette.PD_RECEIVED] == palette.SOURCES[palette.PD_RECEIVED] for c in sources)
    (totals,) = [c for c in chart_colours(app, "name") if palette.PD_RECEIVED in c]
    assert set(totals) == {"vLLM prefix cache", palette.PD_RECEIVED, "computed"}
    assert any(text.PD_SOURCE in t for t in texts(app.caption))
    app.selectbox(key="instance").select(decoder.endpoint).run()
    assert {m.label: m.value for m in app.metric}["Prompt tokens KVLens held"] == text.percent(6000 / 6003)


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
    parts = [f"{p} (ms)" for p in palette.SPLIT]
    assert means.loc[main, parts].sum() == pytest.approx(means.loc[main, "time to first token (ms)"])
    assert means.loc[main, "requests"] == 4
    assert any(
        t.startswith("Means over all 5 requests the proxy timed since it started (all streamed).")
        for t in texts(app.caption)
    ), texts(app.caption)
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
            "decode first token 100.0 ms; proxy (tokenize, relay) 0.0 ms; decoder loaded"
        )
        for t in texts(app.text)
    )
    coloured = phase_colours(app)
    assert len(coloured) == 2  # the pairs' bars and the request's bar
    for chart in coloured:
        assert chart == {name: palette.SPLIT[name] for name in chart}
    (buffers,) = [d.value for d in app.dataframe if "capacity_bytes" in d.value.columns]
    assert list(buffers.index) == [decoder.endpoint]  # the prefiller has no receive buffer
    assert buffers.loc[decoder.endpoint, "fill"] == pytest.approx(0.25)
    assert buffers.loc[decoder.endpoint, "entries"] == 2
    (refused,) = [d.value for d in app.dataframe if "transfers" in d.value.columns]
    keys = zip(refused["where"], refused["reason"], strict=True)
    assert dict(zip(keys, refused["transfers"], strict=True)) == {
        ("sending (prefillers)", "buffer_full"): 1,
        ("sending (prefillers)", "mismatch:tp_size"): 1,  # the mismatching fields named
        ("receiving (decoders)", "buffer_full"): 1,
        ("receiving (decoders)", "expired"): 2,
        ("proxy", "wait timeout 127.0.0.1:8100 → 127.0.0.1:8300"): 1,
    }
    legends = [set(c) for c in chart_colours(app, "series")]
    assert {f"prefiller {prefiller.endpoint} sent", f"decoder {decoder.endpoint} received"} in legends
    assert {f"decoder {decoder.endpoint} used", f"decoder {decoder.endpoint} capacity"} in legends
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
