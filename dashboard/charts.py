"""Altair charts for the views: every chart names its unit on the value axis, and colours each
series by ``dashboard.palette`` (one colour per source and tier, whatever else a chart holds)."""

from __future__ import annotations

from dataclasses import dataclass

import altair as alt
import numpy as np
import pandas as pd

from . import palette


@dataclass(frozen=True, slots=True)
class Unit:
    title: str  # axis title
    fmt: str  # d3 format of axis labels and tooltips
    factor: float = 1.0  # multiply raw values (seconds, bytes) into this unit


RATIO = Unit("share", ".0%")
TOKENS_PER_S = Unit("tokens/s", ",.4~s")
REQUESTS_PER_S = Unit("requests/s", ",.3~f")
OPS_PER_S = Unit("operations/s", ",.3~f")
BLOCKS_PER_S = Unit("blocks/s", ",.3~f")
MS = Unit("ms", ",.3~f", 1e3)
MB = Unit("MB", ",.3~f", 1e-6)
COUNT = Unit("count", ",.4~s")
TOKENS = Unit("tokens", ",.4~s")

# Decimal byte units, largest first (GB/s and MB above were fixed units; these fit the data).
_BYTE_UNITS = ((1e9, "GB"), (1e6, "MB"), (1e3, "KB"), (1.0, "B"))


def bytes_unit(wide: pd.DataFrame, per_s: bool = False, stacked: bool = False) -> Unit:
    """The byte unit whose numbers fit ``wide`` (one column per series, in bytes or bytes/s): the
    largest of B, KB, MB and GB not above its peak (its rows' sums when ``stacked``), so that a
    chart of kilobytes per second reads 12.5 KB/s, not 0.0000125 GB/s."""
    values = (wide.sum(axis=1) if stacked else wide).to_numpy(dtype=float)
    peak = float(np.nanmax(np.abs(values))) if np.isfinite(values).any() else 0.0
    size, name = next(((size, name) for size, name in _BYTE_UNITS if peak >= size), _BYTE_UNITS[-1])
    return Unit(f"{name}/s" if per_s else name, ",.3~f", 1 / size)


HEIGHT = 240
TIME_AXIS = alt.Axis(format="%H:%M:%S", labelOverlap=True)
# Legends below the chart, labels whole: Vega cuts them at 160 px, which left "prefiller
# 10.0.0.1:8100 …" of "prefiller 10.0.0.1:8100 sent" (and a decoder's used and capacity alike).
BOTTOM = alt.Legend(orient="bottom", labelLimit=480)


def colours(field: str, names, legend: alt.Legend | None = None, title: str | None = None) -> alt.Color:
    """A colour channel on ``field`` whose scale maps each name to its palette colour: an
    explicit domain and range, so the colour never depends on which other names exist."""
    domain, colours_ = palette.scale(names)
    return alt.Color(
        f"{field}:N",
        title=title,
        scale=alt.Scale(domain=domain, range=colours_),
        legend=legend,
    )


def to_long(wide: pd.DataFrame, factor: float = 1.0) -> pd.DataFrame:
    """A wide frame (index: epoch seconds, one column per line) as time / series / value rows."""
    if wide.empty:
        return pd.DataFrame({"time": pd.Series(dtype="datetime64[ns, UTC]"), "series": [], "value": []})
    long = wide.rename_axis("t").reset_index().melt(id_vars="t", var_name="series", value_name="value")
    long = long.dropna(subset=["value"])
    long["time"] = pd.to_datetime(long["t"], unit="s", utc=True)
    long["value"] = long["value"].astype(float) * factor
    long["series"] = long["series"].astype(str)
    return long[["time", "series", "value"]]


def line(wide: pd.DataFrame, unit: Unit, stack: bool = False, zero_to_one: bool = False) -> alt.Chart:
    data = to_long(wide, unit.factor)
    scale = alt.Scale(domain=[0, 1]) if zero_to_one else alt.Scale(zero=True)
    y = alt.Y("value:Q", title=unit.title, axis=alt.Axis(format=unit.fmt), scale=scale)
    if stack:
        y = alt.Y("value:Q", title=unit.title, axis=alt.Axis(format=unit.fmt), stack="zero")
    base = alt.Chart(data)
    mark = base.mark_area(opacity=0.7, interpolate="step-after") if stack else base.mark_line(point=False)
    return mark.encode(
        x=alt.X("time:T", title=None, axis=TIME_AXIS),
        y=y,
        color=colours("series", wide.columns, BOTTOM),
        tooltip=[
            alt.Tooltip("time:T", format="%H:%M:%S"),
            "series:N",
            alt.Tooltip("value:Q", format=unit.fmt, title=unit.title),
        ],
    ).properties(height=HEIGHT)


def bars(values: pd.Series, unit: Unit, label: str = "") -> alt.Chart:
    """Horizontal bars, one per index entry."""
    data = pd.DataFrame({"name": [str(i) for i in values.index], "value": values.astype(float) * unit.factor})
    return (
        alt.Chart(data)
        .mark_bar()
        .encode(
            y=alt.Y("name:N", title=label or None, sort=None, axis=alt.Axis(labelLimit=360)),
            x=alt.X("value:Q", title=unit.title, axis=alt.Axis(format=unit.fmt)),
            color=colours("name", data["name"]),
            tooltip=["name:N", alt.Tooltip("value:Q", format=unit.fmt, title=unit.title)],
        )
        .properties(height=alt.Step(28))
    )


def tier_fill(table: pd.DataFrame) -> alt.Chart:
    """Each tier's fill (used of capacity) on one 0-100% scale, whatever the tiers' sizes."""
    data = table.reset_index().assign(
        used=lambda d: d["used_bytes"] * MB.factor,
        capacity=lambda d: d["capacity_bytes"] * MB.factor,
        full=1.0,
        fill=lambda d: d["fill"].fillna(0.0),
    )
    base = alt.Chart(data).encode(y=alt.Y("tier:N", title=None))
    tooltip = [
        "tier:N",
        alt.Tooltip("used:Q", format=MB.fmt, title="used (MB)"),
        alt.Tooltip("capacity:Q", format=MB.fmt, title="capacity (MB)"),
        alt.Tooltip("fill:Q", format=".1%"),
    ]
    x = alt.X("full:Q", title="used of capacity", axis=alt.Axis(format=".0%"), scale=alt.Scale(domain=[0, 1]))
    capacity = base.mark_bar(color="#dddddd").encode(x=x, tooltip=tooltip)
    used = base.mark_bar().encode(x="fill:Q", color=colours("tier", data["tier"]), tooltip=tooltip)
    return (capacity + used).properties(height=alt.Step(32))


def event_timeline(events: pd.DataFrame) -> alt.Chart:
    """Failed loads as points in time: one row per tier, size by blocks, colour by reason."""
    return (
        alt.Chart(events)
        .mark_circle(opacity=0.8)
        .encode(
            x=alt.X("time:T", title=None, axis=TIME_AXIS),
            y=alt.Y("tier:N", title="tier"),
            size=alt.Size("num_blocks:Q", title="blocks", scale=alt.Scale(range=[60, 600])),
            color=colours("reason_kind", sorted(events["reason_kind"].unique()), BOTTOM, "reason"),
            tooltip=[
                alt.Tooltip("time:T", format="%Y-%m-%d %H:%M:%S"),
                "request_id:N",
                "tier:N",
                "reason:N",
                alt.Tooltip("num_blocks:Q", title="blocks"),
                alt.Tooltip("tokens_affected:Q", title="tokens recomputed"),
                "log:N",
            ],
        )
        .properties(height=max(120, 50 * events["tier"].nunique()))
    )


def whatif(curves: pd.DataFrame) -> alt.Chart:
    """Hit ratio against budget factor (log2 axis, 1 = the configured size, marked by a rule)."""
    x = alt.X(
        "factor:Q",
        title="budget (x the configured size)",
        scale=alt.Scale(type="log", base=2, domain=[0.125, 16]),
        axis=alt.Axis(values=[0.125, 0.25, 0.5, 1, 2, 4, 8, 16], format="~g"),
    )
    y = alt.Y(
        "ratio:Q", title="estimated hit ratio", axis=alt.Axis(format=".0%"), scale=alt.Scale(domain=[0, 1])
    )
    tooltip = ["series:N", alt.Tooltip("factor:Q", format="~g"), alt.Tooltip("ratio:Q", format=".1%")]
    lines = (
        alt.Chart(curves)
        .mark_line(point=True)
        .encode(
            x=x,
            y=y,
            color=colours("series", curves["series"], BOTTOM),
            tooltip=tooltip,
        )
    )
    current = alt.Chart(pd.DataFrame({"factor": [1.0], "label": ["configured size"]}))
    rule = current.mark_rule(strokeDash=[4, 4], color="gray").encode(x="factor:Q")
    label = current.mark_text(align="left", dx=4, dy=-6, color="gray").encode(
        x="factor:Q", y=alt.value(8), text="label:N"
    )
    return (lines + rule + label).properties(height=HEIGHT)


def phase_bars(phases: pd.DataFrame, unit: Unit = MS) -> alt.Chart:
    """One horizontal bar per row of ``phases`` (a pair, a prefiller, a request), split into its
    PD phases (one column each, in seconds), each phase in its palette colour."""
    order = [c for c in phases.columns]
    data = (
        phases.rename_axis("what")
        .reset_index()
        .melt(id_vars="what", value_vars=order, var_name="phase", value_name="value")
        .dropna(subset=["value"])
    )
    data["value"] = data["value"].astype(float) * unit.factor
    data["order"] = data["phase"].map({p: i for i, p in enumerate(order)})
    return (
        alt.Chart(data)
        .mark_bar()
        .encode(
            x=alt.X("value:Q", title=unit.title, stack="zero", axis=alt.Axis(format=unit.fmt)),
            y=alt.Y("what:N", title=None, sort=list(phases.index.astype(str)), axis=alt.Axis(labelLimit=360)),
            color=colours("phase", order, BOTTOM, "phase"),
            order=alt.Order("order:Q"),
            tooltip=["what:N", "phase:N", alt.Tooltip("value:Q", format=unit.fmt, title=unit.title)],
        )
        .properties(height=alt.Step(32))
    )
