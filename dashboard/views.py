"""What the dashboard shows, computed from the long sample frame of ``sources``.

Plain pandas functions, no Streamlit: rates from counter snapshots (resets handled, and a
series that appears after its instance was first read counts from 0, as a labelled counter
does at its first increment), ratios that are missing instead of NaN when nothing happened,
histogram quantiles the way Prometheus's ``histogram_quantile`` computes them, and the leak
check. Time series come back "wide": indexed by ``time`` (epoch seconds), one column per line.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from . import catalog as c
from .catalog import LABELS, LEAK_GAUGES, kvlens

SERIES = ("instance", "name", *LABELS)
DEFAULT_WINDOW_S = 30.0


@dataclass(frozen=True, slots=True)
class _Index:
    frame: pd.DataFrame  # held, so that its id is not reused while the entry lives
    by_name: dict[str, pd.DataFrame]
    instance_times: dict[str, np.ndarray]


_INDEXES: dict[int, _Index] = {}
_INDEXES_KEPT = 4
_INDEX_LOCK = threading.Lock()


def _index(frame: pd.DataFrame) -> _Index:
    """The frame split by metric name, and each instance's read times, computed once per frame:
    a page draws a dozen views from one frame, and filtering all of its rows for each costs
    more than drawing them (the last few frames are kept; frames are never modified)."""
    with _INDEX_LOCK:
        held = _INDEXES.get(id(frame))
    if held is not None and held.frame is frame:
        return held
    by_name = {str(n): g for n, g in frame.groupby("name", sort=False)} if not frame.empty else {}
    times = {i: np.sort(g["time"].unique()) for i, g in frame.groupby("instance")} if not frame.empty else {}
    built = _Index(frame, by_name, times)
    with _INDEX_LOCK:
        _INDEXES[id(frame)] = built
        while len(_INDEXES) > _INDEXES_KEPT:
            del _INDEXES[next(iter(_INDEXES))]
    return built


def select(frame: pd.DataFrame, name: str, **labels: str) -> pd.DataFrame:
    df = _index(frame).by_name.get(name)
    if df is None:
        return frame.iloc[0:0]
    for k, v in labels.items():
        df = df[df[k] == v]
    return df


def for_instances(frame: pd.DataFrame, instances: Sequence[str] | None) -> pd.DataFrame:
    """The rows of these instances (the frame itself when it holds no other)."""
    if not instances or set(_index(frame).instance_times) <= set(instances):
        return frame
    return frame[frame["instance"].isin(list(instances))]


def instances(frame: pd.DataFrame) -> list[str]:
    return sorted(frame["instance"].unique()) if not frame.empty else []


# ---- counters --------------------------------------------------------------------------------
def _cumulative(df: pd.DataFrame, instance_times: dict[str, np.ndarray]) -> pd.DataFrame:
    """Per series, reset-corrected running totals; a series first seen after its instance's
    first read gets a 0 at the instance's previous read."""
    out = []
    for key, g in df.sort_values("time").groupby(list(SERIES), sort=False):
        t = g["time"].to_numpy(dtype=float)
        v = g["value"].to_numpy(dtype=float)
        seen = instance_times.get(key[0])
        if seen is not None:
            earlier = seen[seen < t[0]]
            if earlier.size:
                t, v = np.concatenate(([earlier[-1]], t)), np.concatenate(([0.0], v))
        d = np.diff(v, prepend=0.0)
        d = np.where(d < 0, v, d)  # a reset: the counter restarted from 0
        d[0] = v[0]
        labels = dict(zip(SERIES, key, strict=True))
        out.append(pd.DataFrame({"time": t, "sid": len(out), "cum": np.cumsum(d), **labels}))
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame()


def _instance_times(frame: pd.DataFrame) -> dict[str, np.ndarray]:
    return _index(frame).instance_times


def _rates(frame: pd.DataFrame, name: str, window_s: float, **labels: str) -> pd.DataFrame:
    df = select(frame, name, **labels)
    if df.empty:
        return pd.DataFrame()
    cum = _cumulative(df, _instance_times(frame))
    parts = []
    for _, g in cum.groupby("sid", sort=False):
        t, y = g["time"].to_numpy(), g["cum"].to_numpy()
        j = np.clip(np.searchsorted(t, t - window_s, side="right") - 1, 0, None)
        dt = t - t[j]
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.where(dt > 0, (y - y[j]) / np.where(dt > 0, dt, 1), np.nan)
        parts.append(g.assign(v=r).iloc[1:])
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def _sum_aligned(long: pd.DataFrame, by: Sequence[str], label: Callable[[tuple], str]) -> pd.DataFrame:
    """Sum per-series values into one column per ``by`` group at every time any series has a
    value, each series carrying its last value forward (instances are read at different times)."""
    if long.empty:
        return pd.DataFrame()
    wide = long.pivot_table(index="time", columns="sid", values="v", aggfunc="sum").sort_index().ffill()
    keys = long.drop_duplicates("sid").set_index("sid")
    if by:
        groups = keys[list(by)].apply(lambda row: label(tuple(row)), axis=1)
    else:
        groups = pd.Series(label(()), index=keys.index)
    out = wide.T.groupby(groups.reindex(wide.columns)).sum(min_count=1).T
    out.columns.name = None
    return out.dropna(how="all")


def _label(prefix: str = "", default: str = "") -> Callable[[tuple], str]:
    return lambda key: (prefix + " ".join(k for k in key if k)).strip() or default


def rate(
    frame: pd.DataFrame,
    name: str,
    by: Sequence[str] = (),
    window_s: float = DEFAULT_WINDOW_S,
    legend: str = "",
    prefix: str = "",
    **labels: str,
) -> pd.DataFrame:
    """Per-second rate of a counter summed over instances, engines and labels not in ``by``."""
    long = _rates(frame, name, window_s, **labels)
    return _sum_aligned(long, by, _label(prefix, legend or name))


def increase(frame: pd.DataFrame, name: str, by: Sequence[str] = (), **labels: str) -> pd.Series:
    """How much a counter grew over the frame, per ``by`` group (resets handled)."""
    df = select(frame, name, **labels)
    if df.empty:
        return pd.Series(dtype=float)
    cum = _cumulative(df, _instance_times(frame))
    grew = cum.groupby("sid").agg(
        first=("cum", "first"), last=("cum", "last"), **{k: (k, "first") for k in by}
    )
    grew["v"] = grew["last"] - grew["first"]
    return grew.groupby(list(by))["v"].sum() if by else pd.Series({"": grew["v"].sum()})


def total(frame: pd.DataFrame, name: str, by: Sequence[str] = (), **labels: str) -> pd.Series:
    """The latest value of each series (a counter: since its server started), summed per group."""
    df = select(frame, name, **labels)
    if df.empty:
        return pd.Series(dtype=float)
    last = df.sort_values("time").groupby(list(SERIES), sort=False).tail(1)
    return last.groupby(list(by))["value"].sum() if by else pd.Series({"": last["value"].sum()})


def store_total(frame: pd.DataFrame, name: str) -> pd.Series:
    """A tier gauge's latest total per tier, a store several engines share counted once.

    Engines sharing a disk directory each report all of it, labelled ``storage`` with the
    directory's identity: per storage the largest report (the freshest view), not the sum;
    series without a storage (an engine's own memory) add up."""
    df = select(frame, name)
    if df.empty:
        return pd.Series(dtype=float)
    last = df.sort_values("time").groupby(list(SERIES), sort=False).tail(1)
    shared = last["storage"] != ""
    own = last[~shared].groupby("tier")["value"].sum()
    stores = last[shared].groupby(["tier", "storage"])["value"].max().groupby(level="tier").sum()
    return own.add(stores, fill_value=0)


def has_series(frame: pd.DataFrame, name: str) -> bool:
    """Whether any instance exports ``name`` (e.g. the remote tier's round trips)."""
    return not select(frame, name).empty


def scalar(series: pd.Series) -> float:
    return float(series.sum()) if not series.empty else 0.0


def gauge(
    frame: pd.DataFrame, name: str, by: Sequence[str] = (), legend: str = "", prefix: str = "", **labels: str
) -> pd.DataFrame:
    df = select(frame, name, **labels)
    if df.empty:
        return pd.DataFrame()
    long = df.assign(sid=df.groupby(list(SERIES)).ngroup(), v=df["value"])
    return _sum_aligned(long, by, _label(prefix, legend or name))


def ratio(num: pd.DataFrame, den: pd.DataFrame) -> pd.DataFrame:
    """Column by column ``num / den`` where ``den > 0``; missing where nothing was looked up."""
    if num.empty or den.empty:
        return pd.DataFrame()
    num, den = num.align(den, join="outer", axis=0)
    out = num.iloc[:, 0:0].copy()
    for col in num.columns:
        d = den[col] if col in den.columns else den.iloc[:, 0]
        out[col] = (num[col].fillna(0) / d.where(d > 0)).clip(lower=0)
    return out.dropna(how="all")


def join(*parts: pd.DataFrame) -> pd.DataFrame:
    parts = tuple(p for p in parts if not p.empty)
    if not parts:
        return pd.DataFrame()
    return pd.concat(parts, axis=1).sort_index()


# ---- histograms ------------------------------------------------------------------------------
def bucket_quantile(q: float, bounds: np.ndarray, counts: np.ndarray) -> float:
    """Prometheus's ``histogram_quantile`` for one histogram: ``bounds`` ascending (last +Inf),
    ``counts`` cumulative; linear interpolation inside the bucket holding the rank."""
    if len(counts) < 2 or not np.isfinite(counts[-1]) or counts[-1] <= 0:
        return math.nan
    rank = q * counts[-1]
    b = int(np.searchsorted(counts, rank, side="left"))
    b = min(b, len(counts) - 1)
    if math.isinf(bounds[b]):
        return float(bounds[-2])
    lower = 0.0 if b == 0 else float(bounds[b - 1])
    below = 0.0 if b == 0 else float(counts[b - 1])
    inside = float(counts[b]) - below
    if b == 0 and bounds[0] <= 0:
        return float(bounds[0])
    return lower + (float(bounds[b]) - lower) * ((rank - below) / inside if inside > 0 else 1.0)


def quantiles(
    frame: pd.DataFrame,
    bucket: str,
    qs: Sequence[float] = (0.5, 0.95, 0.99),
    window_s: float = DEFAULT_WINDOW_S,
    **labels: str,
) -> pd.DataFrame:
    """One column per quantile (``p50`` ...) of a histogram's observations in each window."""
    rates = _sum_aligned(_rates(frame, bucket, window_s, **labels), ("le",), lambda k: k[0])
    if rates.empty:
        return pd.DataFrame()
    order = sorted(rates.columns, key=float)
    bounds = np.array([float(b) for b in order])
    counts = rates[order].to_numpy()
    out = {
        f"p{round(q * 100)}": [bucket_quantile(q, bounds, np.nan_to_num(row)) for row in counts] for q in qs
    }
    return pd.DataFrame(out, index=rates.index).dropna(how="all")


# ---- the views -------------------------------------------------------------------------------
def misses_by_reason(frame: pd.DataFrame, window_s: float = DEFAULT_WINDOW_S) -> pd.DataFrame:
    return rate(frame, kvlens("miss_requests"), ("reason",), window_s)


def save_skips_by_reason(frame: pd.DataFrame, window_s: float = DEFAULT_WINDOW_S) -> pd.DataFrame:
    return rate(frame, kvlens("save_skipped_requests"), ("reason",), window_s)


def latency(frame: pd.DataFrame, operation: str, window_s: float = DEFAULT_WINDOW_S) -> pd.DataFrame:
    return quantiles(frame, kvlens("operation_seconds", "_bucket"), window_s=window_s, operation=operation)


def remote_round_trips(
    frame: pd.DataFrame, operation: str, window_s: float = DEFAULT_WINDOW_S
) -> pd.DataFrame:
    """Quantiles of the remote tier's round trips (exists: a lookup; get: a load; put, delete)."""
    return quantiles(frame, kvlens("remote_seconds", "_bucket"), window_s=window_s, operation=operation)


def remote_errors(frame: pd.DataFrame, window_s: float = DEFAULT_WINDOW_S) -> pd.DataFrame:
    """Failed remote round trips per second, by operation and kind (timeout, connection, oom...)."""
    return rate(frame, kvlens("remote_errors"), ("operation", "kind"), window_s)


def added(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """Two rate frames summed column by column (a missing column or time counts as 0)."""
    if a.empty or b.empty:
        return a if b.empty else b
    a, b = a.align(b, join="outer")
    return a.ffill().fillna(0) + b.ffill().fillna(0)


def throughput_by_tier(frame: pd.DataFrame, window_s: float = DEFAULT_WINDOW_S) -> pd.DataFrame:
    """Bytes per second spent moving them, per tier ("store cpu", "load disk", ...), timed where
    they move: a store is the gather out of vLLM's KV cache plus the write to disk or remote; a
    load the read from disk or remote plus the copy into the KV cache."""
    seconds = {
        stage: rate(frame, kvlens("transfer_seconds"), ("tier",), window_s, stage=stage)
        for stage in ("gather", "write", "read", "copy")
    }
    stored = rate(frame, kvlens("store_bytes"), ("tier",), window_s)
    loaded = rate(frame, kvlens("transfer_bytes"), ("tier",), window_s, stage="copy")
    store = ratio(stored, added(seconds["gather"], seconds["write"])).add_prefix("store ")
    load = ratio(loaded, added(seconds["read"], seconds["copy"])).add_prefix("load ")
    return join(store, load)


def operations(frame: pd.DataFrame, window_s: float = DEFAULT_WINDOW_S) -> pd.DataFrame:
    return rate(frame, kvlens("operation_seconds", "_count"), ("operation",), window_s)


def tier_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Latest state of each tier: bytes used, budget, fill, chunks, evictions since start (a disk
    directory several engines share counted once)."""
    cols = {
        "used_bytes": store_total(frame, kvlens("tier_used_bytes")),
        "capacity_bytes": store_total(frame, kvlens("tier_capacity_bytes")),
        "chunks": store_total(frame, kvlens("tier_chunks")),
        "evictions": total(frame, kvlens("evictions"), ("tier",)),
    }
    table = pd.DataFrame(cols).fillna(0)
    if table.empty:
        return table
    cap = table["capacity_bytes"]
    table["fill"] = (table["used_bytes"] / cap.where(cap > 0)).astype(float)
    table.index.name = "tier"
    return table[["used_bytes", "capacity_bytes", "fill", "chunks", "evictions"]]


def leak_gauges(frame: pd.DataFrame) -> pd.DataFrame:
    """Every leak gauge summed over tiers, engines and the instances in the frame."""
    return join(*(gauge(frame, kvlens(g), legend=g) for g in LEAK_GAUGES if g != "pinned_bytes"))


@dataclass(frozen=True, slots=True)
class LeakFlag:
    instance: str
    gauge: str
    value: float  # the latest value
    idle_s: float  # how long the engine has had nothing running or waiting


def idle_since(frame: pd.DataFrame, instance: str) -> float | None:
    """When the instance's current idle stretch (nothing running or waiting) began."""
    one = for_instances(frame, [instance])
    busy = join(gauge(one, c.VLLM_RUNNING, legend="busy"), gauge(one, c.VLLM_WAITING, legend="waiting"))
    if busy.empty:
        return None
    load = busy.sum(axis=1)
    if load.iloc[-1] > 0:
        return None
    active = load[load > 0]
    return float(load.index[0] if active.empty else load.index[load.index > active.index[-1]][0])


def leak_flags(frame: pd.DataFrame, idle_for_s: float = 30.0) -> list[LeakFlag]:
    """Gauges that stayed above zero through an idle stretch of at least ``idle_for_s``."""
    flags = []
    for inst in instances(frame):
        start = idle_since(frame, inst)
        one = for_instances(frame, [inst])
        if start is None or one.empty:
            continue
        idle_s = float(one["time"].max()) - start
        if idle_s < idle_for_s:
            continue
        for g in LEAK_GAUGES:
            values = gauge(one, kvlens(g), legend=g)
            if values.empty:
                continue
            stretch = values.loc[values.index >= start].iloc[:, 0]
            if not stretch.empty and (stretch > 0).all():
                flags.append(LeakFlag(inst, g, float(stretch.iloc[-1]), idle_s))
    return flags


def failures(frame: pd.DataFrame, window_s: float = DEFAULT_WINDOW_S) -> pd.DataFrame:
    return rate(frame, kvlens("failed_blocks"), ("reason",), window_s, prefix="failed blocks ")
