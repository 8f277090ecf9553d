"""The PD tab's numbers (``dashboard.pd``, ``dashboard.pd_records``) on the canned PD series and
request records of tests/dashboard/data, with known answers."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from dashboard import catalog, palette, pd_records, sources
from dashboard import pd as pdv

from .conftest import DATA
from .frames import frame, series


def canned(name: str, instance: str, t: float = 100.0, keep=catalog.APP_SAMPLE_NAMES) -> pd.DataFrame:
    rows = [
        (t, instance, n, *labels, v)
        for n, labels, v in sources.parse_samples((DATA / name).read_text(), keep)
    ]
    return pd.DataFrame(rows, columns=list(sources.COLUMNS))


def proxy_frame() -> pd.DataFrame:
    return canned("metrics-pd-proxy.txt", "127.0.0.1:9000", keep=catalog.PROXY_SAMPLE_NAMES)


def engines_frame() -> pd.DataFrame:
    return sources.combine(
        [
            canned("metrics-pd-prefiller.txt", "127.0.0.1:8100"),
            canned("metrics-pd-decoder.txt", "127.0.0.1:8200"),
        ]
    )


def test_the_app_keeps_every_pd_series_it_draws_and_no_histogram_bucket():
    samples = sources.parse_samples((DATA / "metrics-pd-prefiller.txt").read_text())
    names = {n for n, _, _ in samples}
    assert catalog.PD_SENT_BYTES in names and catalog.PD_FAILED_TRANSFERS in names
    assert not any(n.endswith("_bucket") for n in names)
    proxy = {
        n
        for n, _, _ in sources.parse_samples(
            (DATA / "metrics-pd-proxy.txt").read_text(), catalog.PROXY_SAMPLE_NAMES
        )
    }
    assert proxy == catalog.PROXY_SAMPLE_NAMES


def test_the_pd_names_agree_with_what_telemetry_exports_once_it_exports_any():
    """The PD design fixes the names; once telemetry.metrics defines PD metrics, every name the
    dashboards read must be one of them (a rename on either side fails here)."""
    known = catalog.pd_known()
    if known:
        assert catalog.PD_SAMPLE_NAMES <= known, catalog.PD_SAMPLE_NAMES - known
    assert all(n.startswith("vllm:kvlens_pd_") for n in catalog.PD_SAMPLE_NAMES)


def test_phase_means_per_pair_prefiller_and_decoder():
    proxy = proxy_frame()
    pair = pdv.phase_means(proxy)
    main = "127.0.0.1:8100 → 127.0.0.1:8200"
    assert list(pair.index) == [main, "127.0.0.1:8100 → 127.0.0.1:8300"]  # busiest first
    assert pair.loc[main, "prefill"] == pytest.approx(0.5)
    assert pair.loc[main, "transfer wait"] == pytest.approx(0.05)
    assert pair.loc[main, "decode first token"] == pytest.approx(0.1)
    assert pair.loc[main, "time to first token"] == pytest.approx(0.65)
    assert pair.loc[main, "requests"] == 4
    by_prefiller = pdv.phase_means(proxy, ("prefiller",))
    assert by_prefiller.loc["127.0.0.1:8100", "prefill"] == pytest.approx(2.8 / 5)
    assert by_prefiller.loc["127.0.0.1:8100", "requests"] == 5
    by_decoder = pdv.phase_means(proxy, ("decoder",))
    assert by_decoder.loc["127.0.0.1:8300", "transfer wait"] == pytest.approx(0.3)


def test_a_phase_no_request_reached_is_unknown_not_zero():
    p = proxy_frame()
    no_decode = p[~((p["phase"] == "decode_first_token") & (p["decoder"] == "127.0.0.1:8300"))]
    means = pdv.phase_means(no_decode)
    assert math.isnan(means.loc["127.0.0.1:8100 → 127.0.0.1:8300", "decode first token"])
    assert pdv.phase_means(frame()).empty


def test_phases_over_time_are_the_mean_of_each_window_in_phase_order():
    rows = []
    for phase, sums in (
        ("decode_first_token", [0, 1, 2]),
        ("prefill", [0, 5, 10]),
        ("transfer_wait", [0, 0.5, 1]),
    ):
        labels = {"phase": phase, "prefiller": "p", "decoder": "d"}
        rows += series(catalog.PROXY_PHASE + "_sum", sums, "x:9000", **labels)
        rows += series(catalog.PROXY_PHASE + "_count", [0, 10, 20], "x:9000", **labels)
    over = pdv.phases_over_time(frame(*rows), window_s=10)
    assert list(over.columns) == ["prefill", "transfer wait", "decode first token"]
    assert over.loc[20, "prefill"] == pytest.approx(0.5) and over.loc[20, "transfer wait"] == pytest.approx(
        0.05
    )


def test_engine_side_bytes_buffer_in_flight_and_refusals():
    rows = series(catalog.PD_SENT_BYTES, [0, 1e8, 2e8], "p:8100")
    rows += series(catalog.PD_RECEIVED_BYTES, [0, 1e8, 2e8], "d:8200")
    for reason, values in (
        ("buffer_full", [0, 1, 3]),
        ("mismatch:tp_size", [0, 0, 1]),
        ("mismatch:block_size", [0, 1, 1]),
    ):
        rows += series(catalog.PD_FAILED_TRANSFERS, values, "p:8100", side="send", reason=reason)
    f = frame(*rows)
    rates = pdv.bytes_per_s(f, window_s=10)
    assert rates.loc[20, "sent p:8100"] == pytest.approx(1e7) and rates.loc[
        20, "received d:8200"
    ] == pytest.approx(1e7)
    refused = pdv.refusals(f, "send", window_s=10)
    assert sorted(refused.columns) == ["buffer_full", "mismatch"]  # mismatches of any field: one series
    assert refused.loc[20, "buffer_full"] == pytest.approx(0.2) and refused.loc[
        20, "mismatch"
    ] == pytest.approx(0.1)
    assert pdv.refusals(f, "receive").empty
    engines = engines_frame()
    buffers = pdv.buffer_table(engines)
    assert list(buffers.index) == ["127.0.0.1:8200"]
    row = buffers.loc["127.0.0.1:8200"]
    assert (row["used_bytes"], row["capacity_bytes"], row["entries"]) == (1.6e7, 6.4e7, 2)
    assert row["fill"] == pytest.approx(0.25) and row["refused or failed"] == 3
    totals = pdv.refusal_totals(engines, proxy_frame())
    assert set(totals["reason"]) == {
        "buffer_full",
        "mismatch:tp_size",
        "expired",
        "wait timeout 127.0.0.1:8100 → 127.0.0.1:8300",
    }
    flight = pdv.in_flight(engines, proxy_frame())
    assert set(flight.columns) == {"send", "receive", "proxy requests"}


def test_records_read_missing_and_malformed_fields_as_unknown():
    records = pd_records.frame(json.loads((DATA / "pd-requests.json").read_text()) + ["junk", {"no": "id"}])
    assert list(records["req_id"]) == ["pd-3", "pd-2", "pd-1"]
    two = records.set_index("req_id").loc["pd-2"]
    assert (two["bytes received"], two["transfer ms"], two["decoder outcome"]) == (7500000, 12.5, "loaded")
    one = records[records["req_id"] == "pd-1"].iloc[0]
    split = pd_records.split(one)
    assert list(split.index) == ["prefill", "transfer wait", "decode first token"]
    assert split["prefill"] == 510 and split[["transfer wait", "decode first token"]].isna().all()
    text = pd_records.explain(one)
    assert text.startswith(
        "pd-1: time to first token – = prefill 510.0 ms; transfer wait –; decode first token –"
    )


def test_reading_the_proxy_never_raises_and_never_quotes_it(text_server, closed_port):
    text_server.paths[pd_records.PATH] = (DATA / "pd-requests.json").read_text()
    got, status = pd_records.read(text_server.endpoint, limit=7)
    assert status.ok and len(got) == 3 and text_server.asked[-1] == "/kvlens/pd/requests?limit=7"
    text_server.paths[pd_records.PATH] = "<html>secret-canary</html>"
    got, status = pd_records.read(text_server.endpoint)
    assert got.empty and status.state == sources.BAD_RESPONSE and "canary" not in status.detail
    got, status = pd_records.read(f"127.0.0.1:{closed_port}")
    assert got.empty and status.state == sources.UNREACHABLE
    with pytest.raises(ValueError):
        pd_records.parse('{"requests": 3}')
    assert pd_records.parse('{"requests": []}') == []
    assert pd_records.requests_url("http://h:9000/metrics", 5) == "http://h:9000/kvlens/pd/requests?limit=5"
    assert pd_records.metrics_url("h:9000") == "http://h:9000/metrics"


def test_each_phase_has_its_own_colour_everywhere():
    colours = [palette.colour(p) for p in ("prefill", "transfer wait", "decode first token")]
    assert len(set(colours)) == 3
    assert not set(colours) & (
        set(palette.SOURCES.values()) | set(palette.TIERS.values()) | set(palette.QUANTILES.values())
    )
    for label, name in palette.PHASE_LABELS.items():  # the proxy's label value, the app's name
        assert palette.colour(label) == palette.colour(name) == palette.PHASES[name]
    reasons = [palette.colour(r) for r in catalog.PD_REASONS]
    assert len(set(reasons)) == len(reasons)


def test_pd_series_at_zero_are_not_pd():
    """Every engine exports the PD series, at 0 where PD is off: the tab must not take that for PD."""
    off = frame(
        *series(catalog.PD_SENT_BYTES, [0.0, 0.0]),
        *series(catalog.PD_RECEIVED_BYTES, [0.0, 0.0]),
        *series(catalog.PD_BUFFER_CAPACITY, [0.0, 0.0]),
    )
    assert not pdv.has_pd(off)
    decoder = frame(*series(catalog.PD_BUFFER_CAPACITY, [1 << 20], instance="d:8200"))
    assert pdv.has_pd(pd.concat([off, decoder]))
    assert pdv.has_pd(engines_frame())
