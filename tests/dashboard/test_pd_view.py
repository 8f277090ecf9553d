"""The PD tab's numbers (``dashboard.pd``, ``dashboard.pd_split``, ``dashboard.pd_records``) on the
canned PD series and request records of tests/dashboard/data, with known answers: only decoders
have a receive buffer, legends name each engine's role, byte units fit the values, and the split
of time to first token is over one set of requests, its parts adding up to their TTFT."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from dashboard import catalog, charts, palette, pd_records, pd_split, sources
from dashboard import pd as pdv

from .conftest import DATA
from .frames import DECODER, PREFILLER, frame, pd_pair, series


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


def records() -> pd.DataFrame:
    return pd_records.frame(json.loads((DATA / "pd-requests.json").read_text()))


def test_the_split_since_the_proxy_started_when_every_request_was_streamed():
    """The canned proxy timed every phase for the same requests (as many of each): the split is
    the histogram's means since the proxy started, the proxy's own part the rest of the TTFT."""
    split = pd_split.split(proxy_frame(), records())
    main = "127.0.0.1:8100 → 127.0.0.1:8200"
    assert list(split.table.index) == [main, "127.0.0.1:8100 → 127.0.0.1:8300"]  # busiest first
    row = split.table.loc[main]
    assert (row["prefill"], row["transfer wait"], row["decode first token"]) == pytest.approx(
        (0.5, 0.05, 0.1)
    )
    assert row[palette.PROXY] == pytest.approx(0.0) and row["time to first token"] == pytest.approx(0.65)
    assert row["requests"] == 4
    assert (split.table[palette.PROXY] == 0).all()  # not -2e-16 s: the sums' rounding (axis from -100 ms)
    assert split.population == "all 5 requests the proxy timed since it started (all streamed)"
    by_decoder = pd_split.split(proxy_frame(), records(), ("decoder",)).table
    assert by_decoder.loc["127.0.0.1:8300", "transfer wait"] == pytest.approx(0.3)


def mixed_proxy() -> pd.DataFrame:
    """10 requests on one pair, 4 of them streamed: prefill and transfer wait timed for all 10,
    decode first token and time to first token for the 4 (the proxy cannot time a first token it
    does not stream). Means of each phase: 100 + 20 + 48 = 168 ms, where the TTFT says 206 ms."""
    rows = []
    pair = {"prefiller": "p:7100", "decoder": "d:7200"}
    for phase, total_s, n in (
        ("prefill", 1.0, 10),
        ("transfer_wait", 0.2, 10),
        ("decode_first_token", 0.192, 4),
        ("ttft", 0.824, 4),
    ):
        rows += series(catalog.PROXY_PHASE + "_sum", [total_s], "x:9000", phase=phase, **pair)
        rows += series(catalog.PROXY_PHASE + "_count", [n], "x:9000", phase=phase, **pair)
    return frame(*rows)


def streamed_records() -> pd.DataFrame:
    """The proxy's newest records of that pair: 4 streamed (every phase timed), 2 not (no first token)."""
    base = {"prefiller": "p:7100", "decoder": "d:7200", "outcome": "ok"}
    streamed = [
        {
            **base,
            "req_id": f"s{i}",
            "prefill_ms": p,
            "transfer_wait_ms": w,
            "decode_first_token_ms": d,
            "ttft_ms": t,
        }
        for i, (p, w, d, t) in enumerate(
            ((130, 20, 40, 200), (140, 30, 50, 230), (120, 20, 50, 195), (130, 10, 52, 199))
        )
    ]
    whole = [
        {**base, "req_id": f"w{i}", "prefill_ms": 80, "transfer_wait_ms": 20, "ttft_ms": None}
        for i in range(2)
    ]
    return pd_records.frame(streamed + whole)


def test_a_split_is_over_one_set_of_requests_and_adds_up_to_the_ttft_beside_it():
    """Prefill averaged over every request and the first token over streamed ones gave bars of
    168 ms beside a TTFT of 206 ms. Over the streamed requests alone, every part adds up."""
    proxy = mixed_proxy()
    assert pd_split.from_histogram(proxy) is None  # phases timed for different requests
    split = pd_split.split(proxy, streamed_records())
    (row,) = [r for _, r in split.table.iterrows()]
    parts = row[list(pd_split.SPLIT_COLUMNS)]
    assert parts.sum() == pytest.approx(row["time to first token"]) == pytest.approx(0.206)
    assert row["prefill"] == pytest.approx(0.130) and row["decode first token"] == pytest.approx(0.048)
    assert row[palette.PROXY] == pytest.approx(0.206 - 0.130 - 0.020 - 0.048)
    assert row["requests"] == 4
    assert split.population == (
        "the 4 streamed requests among the proxy's newest 6 records that reached their first token"
    )
    empty = pd_split.split(proxy, pd_records.frame([]))
    assert empty.table.empty and empty.population == ""
    note = pd_split.mixed_note(proxy, records_read=False)
    assert note.startswith("No split: the proxy timed its phases for different requests (prefill 10, ")
    assert "time to first token 4" in note and "--pd-proxy" in note
    assert pd_split.mixed_note(frame(), records_read=True) == "No PD request timed by the proxy yet."


def test_phases_over_time_are_each_phases_mean_in_its_window_beside_the_ttft():
    rows = []
    for phase, sums, counts in (
        ("decode_first_token", [0, 1, 2], [0, 4, 8]),
        ("prefill", [0, 5, 10], [0, 10, 20]),
        ("transfer_wait", [0, 0.5, 1], [0, 10, 20]),
        ("ttft", [0, 2, 4], [0, 4, 8]),
    ):
        labels = {"phase": phase, "prefiller": "p", "decoder": "d"}
        rows += series(catalog.PROXY_PHASE + "_sum", sums, "x:9000", **labels)
        rows += series(catalog.PROXY_PHASE + "_count", counts, "x:9000", **labels)
    over = pd_split.phases_over_time(frame(*rows), window_s=10)
    assert list(over.columns) == ["prefill", "transfer wait", "decode first token", "time to first token"]
    assert over.loc[20, "prefill"] == pytest.approx(0.5) and over.loc[
        20, "decode first token"
    ] == pytest.approx(0.25)
    assert over.loc[20, "time to first token"] == pytest.approx(0.5)


def test_only_decoders_have_a_receive_buffer():
    """Every engine exports the buffer's series, at 0 on a prefiller: the prefiller is no decoder."""
    engines = engines_frame()
    assert pdv.decoders(engines) == ["127.0.0.1:8200"] and pdv.prefillers(engines) == ["127.0.0.1:8100"]
    buffers = pdv.buffer_table(engines)
    assert list(buffers.index) == ["127.0.0.1:8200"]
    assert list(pdv.buffer_over_time(engines).columns) == [
        "decoder 127.0.0.1:8200 used",
        "decoder 127.0.0.1:8200 capacity",
    ]


def test_legends_name_each_engines_role():
    bytes_ = pdv.bytes_per_s(pd_pair_moving(), window_s=10)
    assert list(bytes_.columns) == [f"prefiller {PREFILLER} sent", f"decoder {DECODER} received"]
    flight = pdv.in_flight(engines_frame(), proxy_frame())
    assert list(flight.columns) == ["receiving (decoders)", "sending (prefillers)", "proxy requests"]


def pd_pair_moving(bytes_per_s: float = 12_500) -> pd.DataFrame:
    """The PD pair, with the prefiller sending and the decoder receiving ``bytes_per_s``; each
    exports the other side's counter at 0."""
    moved = [0, 10 * bytes_per_s, 20 * bytes_per_s]
    return pd.concat(
        [
            pd_pair(),
            frame(
                *series(catalog.PD_SENT_BYTES, moved, PREFILLER),
                *series(catalog.PD_RECEIVED_BYTES, [0, 0, 0], PREFILLER),
                *series(catalog.PD_SENT_BYTES, [0, 0, 0], DECODER),
                *series(catalog.PD_RECEIVED_BYTES, moved, DECODER),
            ),
        ],
        ignore_index=True,
    )


@pytest.mark.parametrize(
    ("per_s", "title", "shown"),
    [(500, "B/s", 500), (12_500, "KB/s", 12.5), (3.2e6, "MB/s", 3.2), (2.5e9, "GB/s", 2.5)],
)
def test_the_bytes_chart_is_in_a_unit_that_fits_the_values(per_s, title, shown):
    moved = pdv.bytes_per_s(pd_pair_moving(per_s), window_s=10)
    unit = charts.bytes_unit(moved, per_s=True)
    assert unit.title == title
    drawn = charts.to_long(moved, unit.factor)
    assert drawn["value"].max() == pytest.approx(shown)


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
    rates = pdv.bytes_per_s(f, window_s=10)  # no kvlens_info: the engines that moved bytes
    assert rates.loc[20, "prefiller p:8100 sent"] == pytest.approx(1e7)
    assert rates.loc[20, "decoder d:8200 received"] == pytest.approx(1e7)
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
    assert set(totals["where"]) == {"sending (prefillers)", "receiving (decoders)", "proxy"}


def test_records_read_missing_and_malformed_fields_as_unknown():
    records = pd_records.frame(json.loads((DATA / "pd-requests.json").read_text()) + ["junk", {"no": "id"}])
    assert list(records["req_id"]) == ["pd-3", "pd-2", "pd-1"]
    two = records.set_index("req_id").loc["pd-2"]
    assert (two["bytes received"], two["transfer ms"], two["decoder outcome"]) == (7500000, 12.5, "loaded")
    one = records[records["req_id"] == "pd-1"].iloc[0]
    split = pd_records.split(one)
    assert list(split.index) == ["prefill", "transfer wait", "decode first token", palette.PROXY]
    assert (
        split["prefill"] == 510 and split[["transfer wait", "decode first token", palette.PROXY]].isna().all()
    )
    assert pd_records.split(records.set_index("req_id").loc["pd-2"]).sum() == 640  # its TTFT
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
