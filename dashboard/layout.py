"""Streamlit pieces shared by the app's tabs (``app.py`` and ``insights_page.py``)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from . import charts
from .text import UNKNOWN

NO_TRAFFIC = "No traffic in range."


def chart(wide: pd.DataFrame, unit: charts.Unit, empty: str, **kwargs) -> None:
    """A line chart of ``wide`` (one column per series), or ``empty`` when there is no data."""
    if wide.empty:
        st.info(empty)
    else:
        st.altair_chart(charts.line(wide, unit, **kwargs), width="stretch")


def table(data: pd.DataFrame, where=st, **kwargs) -> None:
    """A table whose missing values (a ratio of nothing, a cost not measured) read "–", not None."""
    where.dataframe(data, placeholder=UNKNOWN, **kwargs)
