"""The app's Blending tab (``enable_blending``): what blended requests reused and recomputed,
the blends that failed over to a full prefill, and the deviation that chose what to recompute."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from . import charts, views
from .catalog import kvlens
from .layout import NO_TRAFFIC, chart, table

TOKENS = kvlens("blend_tokens")
REQUESTS = kvlens("blend_requests")
BY_TENANT = kvlens("tenant_blend_tokens")
KINDS = {
    "reused": "reused (from a tier)",
    "recomputed_by_deviation": "recomputed: deviated most",
    "not_stored": "computed: not stored",
}
NONE_YET = (
    "No blended requests yet: blending is off (enable_blending), or no prompt held the separator "
    "(blend_special_str) with a segment of blend_min_tokens or more."
)
ABOUT = (
    "A blended prompt holds the separator (blend_special_str) between documents whose KV KVLens "
    "stored before, wherever they sat: their KV is moved to its new positions and the tokens whose K "
    "deviates most at the check layer are recomputed (blend_recompute_ratios). Reused minus "
    "recomputed is what blending saved over a full prefill; each response's kvlens.blend says it "
    "per request."
)


def tokens_by_kind(frame: pd.DataFrame, window_s: float) -> pd.DataFrame:
    """Tokens per second of blended prompts, by what the blend did with them."""
    parts = [
        views.rate(frame, TOKENS, (), window_s, legend=label, kind=kind) for kind, label in KINDS.items()
    ]
    return views.join(*parts)


def recomputed_share(frame: pd.DataFrame, window_s: float) -> pd.DataFrame:
    """The share of blended prompts' tokens the blend computed."""
    computed = views.rate(frame, TOKENS, (), window_s, legend="recomputed share", kind="recomputed")
    reused = views.rate(frame, TOKENS, (), window_s, legend="recomputed share", kind="reused")
    new = views.rate(frame, TOKENS, (), window_s, legend="recomputed share", kind="not_stored")
    return views.ratio(computed, views.added(reused, new))


def by_tenant(frame: pd.DataFrame) -> pd.DataFrame:
    """Per tenant, since each instance started: tokens reused and recomputed, and the recomputed
    share (tenants that never blended are left out)."""
    totals = views.total(frame, BY_TENANT, ("tenant", "kind"))
    if totals.empty:
        return pd.DataFrame()
    table = totals.unstack("kind").reindex(columns=["reused", "recomputed"]).fillna(0.0)
    table = table[table.sum(axis=1) > 0]
    table["recomputed share"] = table["recomputed"] / (table["reused"] + table["recomputed"])
    return table.sort_values("reused", ascending=False)


def show(frame: pd.DataFrame, window: float) -> None:
    done = views.total(frame, REQUESTS, ("outcome",)) if views.has_series(frame, REQUESTS) else pd.Series()
    blended, failed = int(done.get("blended", 0)), int(done.get("failed", 0))
    if not blended + failed:
        st.info(NONE_YET)
        return
    reused = views.scalar(views.total(frame, TOKENS, kind="reused"))
    recomputed = views.scalar(views.total(frame, TOKENS, kind="recomputed"))
    a, b, c = st.columns(3)
    a.metric("Blended requests", f"{blended:,}", help="since each instance started")
    b.metric("Failed over to a full prefill", f"{failed:,}")
    c.metric("Tokens reused / recomputed", f"{reused:,.0f} / {recomputed:,.0f}")
    left, right = st.columns(2)
    with left:
        st.subheader("Blended prompt tokens")
        chart(tokens_by_kind(frame, window), charts.TOKENS_PER_S, NO_TRAFFIC, stack=True)
    with right:
        st.subheader("Recomputed share")
        chart(recomputed_share(frame, window), charts.RATIO, NO_TRAFFIC, zero_to_one=True)
    tenants = by_tenant(frame)
    if not tenants.empty:
        st.subheader("By tenant")
        percent = st.column_config.NumberColumn(format="percent")
        table(tenants, width="stretch", column_config={"recomputed share": percent})
    st.caption(ABOUT)
