"""The app's Tenants tab: hit ratio, tokens loaded and bytes held per tenant. Lays out what
``dashboard.tenants`` computes (kept out of app.py to keep that file short)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from . import charts, tenants
from .layout import NO_TRAFFIC, chart, table

ABOUT = (
    "A tenant is a cache salt or a set of key tags (lmcache.tag.*): requests of different tenants "
    "never share KV. KVLens names each by a hash keyed with the deployment's secret "
    "(salt:3fa1c2d90b7e4f01, user:9e2a41c07d5b3a88), "
    "never the salt or tag value; default: requests with neither; other: tenants seen after the "
    "first extra_config.tenant_labels_max (10)."
)


def show(frame: pd.DataFrame, window: float) -> None:
    if not tenants.has_tenants(frame):
        st.info("No per-tenant series yet: this KVLens version does not export them, or no data.")
        return
    st.subheader("Per tenant since start")
    percent = st.column_config.NumberColumn(format="percent")
    table(tenants.table(frame), width="stretch", column_config={"hit ratio": percent})
    left, right = st.columns(2)
    with left:
        st.subheader("Hit ratio per tenant")
        chart(tenants.hit_ratios(frame, window), charts.RATIO, NO_TRAFFIC, zero_to_one=True)
    with right:
        st.subheader("Tokens loaded per tenant")
        chart(tenants.loaded(frame, window), charts.TOKENS_PER_S, NO_TRAFFIC, stack=True)
    st.subheader("Bytes held per tenant and tier")
    held = tenants.bytes_held(frame)
    chart(held, charts.bytes_unit(held, stacked=True), "No tenant holds bytes yet.", stack=True)
    st.caption(ABOUT)
