"""The app's Insights tab: tier sizing, instances that can share KV, reconciliation of what
vLLM, KVLens's lookups and its loads counted, and prefill time saved against time spent.
Lays out what ``dashboard.insights`` computes (kept out of app.py to keep that file short)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from . import charts, insights, text
from .layout import NO_TRAFFIC, chart, table


def sizing(frame: pd.DataFrame) -> None:
    st.subheader("Tier sizing: hit ratio at other budgets")
    curves = insights.whatif_curves(frame)
    if curves.empty:
        st.info("No what-if estimate yet: a tier reports one once it has seen references.")
        return
    st.altair_chart(charts.whatif(curves), width="stretch")
    for series in curves["series"].unique():
        tier = curves.loc[curves["series"] == series, "tier"].iloc[0]
        advice = insights.sizing_advice(insights.curve_of(curves, series), tier)
        if advice:
            st.markdown(f"**{series}**: {advice}")
    st.caption("Estimated from sampled references; 1x is each tier's configured size.")


def identity(fleet: pd.DataFrame) -> None:
    st.subheader("Instances and who can share KV")
    shared = insights.instance_identity(fleet)
    if shared.empty:
        st.info("No instance reports vllm:kvlens_info yet.")
        return
    for name in shared.index[shared["alone"]]:
        if len(shared) > 1:
            st.warning(f"{name} shares KV with no other instance (key, chunk size or storage differ).")
    table(shared, width="stretch")
    st.caption(
        "Instances share KV only with equal key fingerprint and chunk size and a common storage "
        "entry; a group links instances directly or through others."
    )


def reconciliation(frame: pd.DataFrame, window: float) -> None:
    st.subheader("Reconciliation: vLLM external hits, KVLens held, KVLens loaded")
    chart(insights.reconciliation(frame, window), charts.TOKENS_PER_S, NO_TRAFFIC)
    st.caption(
        "KVLens held at lookup includes tokens vLLM's own cache already had; vLLM's external hits "
        "are what it asked KVLens to load; loaded below that means loads went missing or failed. On a PD "
        "decoder vLLM's external hits also count what it received from a prefiller (PD): compare them "
        "with loaded plus received."
    )


def time_saved(frame: pd.DataFrame, window: float) -> None:
    b = insights.balance(frame)
    a, c, d, e = st.columns(4)
    a.metric(
        "Prefill time saved",
        text.seconds(b.saved_s),
        delta=None if b.saved_s_window is None else f"+{text.seconds(b.saved_s_window)} in range",
        delta_color="off",
        help="The connector's estimate (vllm:kvlens_prefill_seconds_saved_total), since the servers started.",
    )
    c.metric("KVLens time spent", text.seconds(b.spent_s), help="Lookups, loads and stores, since start.")
    d.metric(
        "Net", text.seconds(b.net_s), help="Saved minus spent: below zero KVLens costs more than it saves."
    )
    e.metric("Prefill cost per token", text.seconds(b.per_token_s), help="The engine's measured cost.")
    left, right = st.columns(2)
    with left:
        st.subheader("Saved by tier vs KVLens's own time")
        chart(insights.time_balance(frame, window), charts.Unit("seconds/s", ",.3~f"), NO_TRAFFIC)
    with right:
        st.subheader("Prefill cost per token")
        chart(insights.prefill_cost(frame), charts.MS, "No prefill cost reported.")


def show(frame: pd.DataFrame, fleet: pd.DataFrame, window: float) -> None:
    sizing(frame)
    identity(fleet)
    reconciliation(frame, window)
    time_saved(frame, window)
