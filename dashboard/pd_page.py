"""The app's PD tab (prefill/decode disaggregation): where a PD request's time to first token
goes (prefill, waiting for the transfer's notifications, the decoder's first token) per
prefiller, decoder and pair, and for one chosen request; and the transfers themselves: bytes/s
sent and received, receive buffer used of capacity, transfers in flight, refusals and timeouts
by reason. Lays out what ``dashboard.pd`` and ``dashboard.pd_records`` compute; reads the PD
proxy only while this tab is open."""

from __future__ import annotations

import time

import pandas as pd
import streamlit as st

from . import catalog, charts, pd_records, pd_split, settings, sources
from . import pd as pdv
from .layout import NO_TRAFFIC, chart, table
from .text import UNKNOWN

NO_PD = (
    "No PD series yet: no engine exports vllm:kvlens_pd_* (PD needs enable_pd on a prefiller and a "
    "decoder) and no PD proxy was read (start the app with --pd-proxy HOST:PORT or "
    "KVLENS_DASHBOARD_PD_PROXY)."
)
ABOUT = (
    "prefill: the prefiller computing the prompt (the proxy's request to it); transfer wait: from its "
    "answer until every prefiller rank's notification arrived (the KV is in the decoder's buffer); "
    "decode first token: the decoder's first streamed token; proxy (tokenize, relay): the rest, the "
    "proxy's own time between them. Every part is a mean over the same requests, so the parts add up "
    "to the time to first token beside them."
)


@st.cache_resource(show_spinner=False)
def _proxy_history(url: str, max_points: int) -> sources.MetricsHistory:
    return sources.MetricsHistory(
        url, max_points=max_points, keep=catalog.PROXY_SAMPLE_NAMES, expect=catalog.PROXY_PREFIX
    )


@st.cache_resource(show_spinner=False)
def _prometheus(url: str) -> sources.PrometheusSource:
    return sources.PrometheusSource(url)


def proxy_frame(cfg: settings.Settings) -> tuple[pd.DataFrame, sources.Status | None]:
    """The proxy's series: from Prometheus when the app reads Prometheus, else its /metrics."""
    if cfg.source == settings.PROMETHEUS and cfg.prometheus:
        src = _prometheus(cfg.prometheus)
        got = src.frame(cfg.minutes, names=catalog.PROXY_SAMPLE_NAMES, expect=catalog.PROXY_PREFIX)
        return got, src.status
    if not cfg.pd_proxy:
        return sources.empty_frame(), None
    points = int(cfg.minutes * 60 / cfg.refresh_s) + 1
    held = _proxy_history(pd_records.metrics_url(cfg.pd_proxy), points)
    status = held.scrape(time.time())
    return held.frame(), status


def proxy_message(status: sources.Status | None) -> tuple[str, str] | None:
    """(level, text) for a proxy source that is not OK (never a quote of what it sent)."""
    if status is None or status.ok:
        return None
    detail = f" ({status.detail})" if status.detail else ""
    if status.state == sources.UNREACHABLE:
        return "error", f"PD proxy unreachable: {status.source}{detail}. Is kvlens pd-proxy running there?"
    if status.state == sources.NO_KVLENS:
        return "warning", f"No kvlens_pd_proxy_* series at {status.source}: is it a kvlens pd-proxy?"
    if status.state == sources.NO_DATA:
        return "info", f"No PD proxy data yet from {status.source}{detail}"
    return "error", f"PD proxy not read: {status.source}{detail}"


def show(frame: pd.DataFrame, window: float, cfg: settings.Settings) -> None:
    proxy, proxy_status = proxy_frame(cfg)
    records, records_status = pd_records.read(cfg.pd_proxy) if cfg.pd_proxy else (pd_records.frame([]), None)
    for status in (proxy_status, records_status):
        if message := proxy_message(status):
            getattr(st, message[0])(message[1])
    if not pdv.has_pd(frame) and not pdv.has_proxy(proxy) and records.empty:
        st.info(NO_PD)
        return
    split_by_group(proxy, records, window, records_read=bool(cfg.pd_proxy))
    one_request(records)
    transfers(frame, proxy, window)


def split_by_group(proxy: pd.DataFrame, records: pd.DataFrame, window: float, records_read: bool) -> None:
    st.subheader("Time to first token, split")
    by = st.radio("Per", list(pd_split.GROUPINGS), horizontal=True, key="pd_group")
    split = pd_split.split(proxy, records, pd_split.GROUPINGS[by])
    if split.table.empty:
        st.info(pd_split.mixed_note(proxy, records_read))
    else:
        st.altair_chart(charts.phase_bars(split.table[list(pd_split.SPLIT_COLUMNS)]), width="stretch")
        ms = split.table.copy()
        for column in (*pd_split.SPLIT_COLUMNS, pd_split.TTFT):
            ms[column] = ms[column] * 1e3
        table(ms.rename(columns=lambda c: f"{c} (ms)" if c != pd_split.REQUESTS else c), width="stretch")
        st.caption(f"Means over {split.population}. " + ABOUT)
    st.subheader("Phases over time")
    chart(pd_split.phases_over_time(proxy, window), charts.MS, NO_TRAFFIC)
    st.caption(
        "Each phase's mean over the requests that reached it in each window (time to first token and "
        "decode first token: streamed requests only), all pairs together: lines, not a stack, since "
        "their requests differ."
    )


def one_request(records: pd.DataFrame) -> None:
    st.subheader("One request")
    if records.empty:
        st.info("No request records: the PD proxy (--pd-proxy) has recorded none, or none was read.")
        return
    ids = list(records["req_id"])
    chosen = st.selectbox("Request (newest first)", ids, key="pd_request")
    request = records[records["req_id"] == chosen].iloc[0]
    st.text(pd_records.explain(request))
    split = pd_records.split(request)
    if split.notna().any():
        bar = pd.DataFrame([split.values], columns=split.index, index=[str(chosen)]) / 1e3
        st.altair_chart(charts.phase_bars(bar), width="stretch")
    else:
        st.info(f"{chosen}: no phase was timed ({UNKNOWN}).")
    table(records.head(200), width="stretch", hide_index=True)


def transfers(frame: pd.DataFrame, proxy: pd.DataFrame, window: float) -> None:
    left, right = st.columns(2)
    with left:
        st.subheader("Bytes sent and received")
        moved = pdv.bytes_per_s(frame, window)
        chart(moved, charts.bytes_unit(moved, per_s=True), "No PD transfer in range.")
    with right:
        st.subheader("Receive buffer: used and capacity")
        held = pdv.buffer_over_time(frame)
        chart(held, charts.bytes_unit(held), "No decoder reports a PD buffer.")
    buffers = pdv.buffer_table(frame)
    if not buffers.empty:
        fill = st.column_config.NumberColumn(format="percent")
        table(buffers, width="stretch", column_config={"fill": fill})
        st.caption(
            "entries: transfers held in the buffer (received, not yet loaded or expired); with nothing "
            "in flight it returns to 0, else slots leak."
        )
    left, right = st.columns(2)
    with left:
        st.subheader("Transfers in flight")
        chart(pdv.in_flight(frame, proxy), charts.COUNT, "No PD transfer reported.")
    with right:
        st.subheader("Proxy waits past their bound")
        chart(pdv.proxy_timeouts(proxy, window), charts.REQUESTS_PER_S, "No proxy wait timed out in range.")
    left, right = st.columns(2)
    with left:
        st.subheader("Refused or failed: prefiller side")
        chart(pdv.refusals(frame, "send", window), charts.REQUESTS_PER_S, "No refused send in range.")
    with right:
        st.subheader("Refused or failed: decoder side")
        chart(pdv.refusals(frame, "receive", window), charts.REQUESTS_PER_S, "No refused receive in range.")
    totals = pdv.refusal_totals(frame, proxy)
    if not totals.empty:
        table(totals, width="stretch", hide_index=True)
