"""The PD (prefill/decode disaggregation) tab's numbers, from the long sample frame of
``sources``: the proxy's split of time to first token into prefill, transfer wait and decode
first token (``kvlens_pd_proxy_phase_seconds``) per prefiller, decoder or pair; and the engines'
PD series: bytes sent and received, receive buffer used of capacity, transfers in flight,
refusals and timeouts by reason. Plain pandas, no Streamlit.
"""

from __future__ import annotations

import math

import pandas as pd

from . import catalog as c
from . import palette
from .views import DEFAULT_WINDOW_S, SERIES, gauge, join, rate, ratio, select, total

PAIR = ("prefiller", "decoder")
GROUPINGS = {"pair": PAIR, "prefiller": ("prefiller",), "decoder": ("decoder",)}
PHASE_COLUMNS = tuple(palette.PHASE_LABELS[p] for p in c.PD_PHASES)


def has_pd(frame: pd.DataFrame) -> bool:
    """Whether any engine runs PD: it moved PD bytes or holds a receive buffer (every engine
    exports the PD series, at 0 where PD is off)."""
    names = (c.PD_SENT_BYTES, c.PD_RECEIVED_BYTES, c.PD_BUFFER_CAPACITY)
    return any(bool((select(frame, n)["value"] > 0).any()) for n in names)


def has_proxy(frame: pd.DataFrame) -> bool:
    return not select(frame, c.PROXY_PHASE + "_count").empty


def phase_means(proxy: pd.DataFrame, by: tuple[str, ...] = PAIR) -> pd.DataFrame:
    """Per group (``by``: prefiller, decoder or both), the mean seconds of each phase and of the
    whole time to first token since the proxy started, and the requests timed; a phase no request
    of the group reached is missing (NaN), not 0."""
    keys = (*by, "phase")
    seconds = total(proxy, c.PROXY_PHASE + "_sum", keys)
    counts = total(proxy, c.PROXY_PHASE + "_count", keys)
    if counts.empty:
        return pd.DataFrame(columns=[*PHASE_COLUMNS, "time to first token", "requests"])
    mean = (seconds / counts.where(counts > 0)).unstack("phase")
    n = counts.unstack("phase")
    out = pd.DataFrame(index=mean.index)
    for phase, column in zip(c.PD_PHASES, PHASE_COLUMNS, strict=True):
        out[column] = mean[phase] if phase in mean.columns else math.nan
    out["time to first token"] = mean[c.PD_TTFT] if c.PD_TTFT in mean.columns else math.nan
    timed = n[c.PD_TTFT] if c.PD_TTFT in n.columns else n.max(axis=1)
    out["requests"] = timed.fillna(0)
    if len(by) > 1:
        out.index = pd.Index([" → ".join(k) for k in out.index], name=" → ".join(by))
    else:
        out.index.name = by[0]
    return out.sort_values("requests", ascending=False)


def phases_over_time(proxy: pd.DataFrame, window_s: float = DEFAULT_WINDOW_S) -> pd.DataFrame:
    """The mean seconds of each phase over each window, all pairs together."""
    sums = rate(proxy, c.PROXY_PHASE + "_sum", ("phase",), window_s)
    counts = rate(proxy, c.PROXY_PHASE + "_count", ("phase",), window_s)
    mean = ratio(sums, counts)
    mean = mean[[p for p in c.PD_PHASES if p in mean.columns]]
    return mean.rename(columns=palette.PHASE_LABELS)


def bytes_per_s(frame: pd.DataFrame, window_s: float = DEFAULT_WINDOW_S) -> pd.DataFrame:
    """Bytes per second each instance sent (prefillers) and received (decoders)."""
    return join(
        rate(frame, c.PD_SENT_BYTES, ("instance",), window_s, prefix="sent "),
        rate(frame, c.PD_RECEIVED_BYTES, ("instance",), window_s, prefix="received "),
    )


def buffer_over_time(frame: pd.DataFrame) -> pd.DataFrame:
    """Each decoder's receive buffer, used and capacity, in bytes."""
    return join(
        gauge(frame, c.PD_BUFFER_USED, ("instance",), prefix="used "),
        gauge(frame, c.PD_BUFFER_CAPACITY, ("instance",), prefix="capacity "),
    )


def in_flight(frame: pd.DataFrame, proxy: pd.DataFrame | None = None) -> pd.DataFrame:
    """Transfers in flight by side (send: prefillers, receive: decoders), and the requests the
    proxy has in flight."""
    parts = [gauge(frame, c.PD_IN_FLIGHT, ("side",))]
    if proxy is not None:
        parts.append(gauge(proxy, c.PROXY_IN_FLIGHT, legend="proxy requests"))
    return join(*parts)


def reason_kind(reason: str) -> str:
    """``mismatch:tp_size,block_size`` -> ``mismatch``: one series per kind of reason."""
    return reason.split(":", 1)[0]


def _by_reason_kind(frame: pd.DataFrame, name: str) -> pd.DataFrame:
    """The counter's series with their reasons cut to kinds, the series of one kind summed at
    each reading (the counters of two mismatches become one counter)."""
    df = select(frame, name)
    if df.empty:
        return df
    df = df.assign(reason=df["reason"].map(reason_kind))
    keys = ["time", *SERIES]
    return df.groupby(keys, as_index=False, sort=False)["value"].sum()[list(frame.columns)]


def refusals(frame: pd.DataFrame, side: str, window_s: float = DEFAULT_WINDOW_S) -> pd.DataFrame:
    """Refused or failed transfers per second on one side (send or receive), by kind of reason."""
    df = _by_reason_kind(frame, c.PD_FAILED_TRANSFERS)
    return rate(df, c.PD_FAILED_TRANSFERS, ("reason",), window_s, side=side) if not df.empty else df


def proxy_timeouts(proxy: pd.DataFrame, window_s: float = DEFAULT_WINDOW_S) -> pd.DataFrame:
    """The proxy's waits for the notifications that ran past its bound, per second, by pair."""
    return rate(proxy, c.PROXY_WAIT_TIMEOUTS, PAIR, window_s, prefix="timed out ")


def refusal_totals(frame: pd.DataFrame, proxy: pd.DataFrame | None = None) -> pd.DataFrame:
    """Refused or failed transfers since each server started, by side and full reason (the
    mismatching fields named), and the proxy's wait timeouts by pair."""
    rows = [
        {"where": f"engines, {side}", "reason": reason, "transfers": v}
        for (side, reason), v in total(frame, c.PD_FAILED_TRANSFERS, ("side", "reason")).items()
    ]
    if proxy is not None:
        for (p, d), v in total(proxy, c.PROXY_WAIT_TIMEOUTS, PAIR).items():
            rows.append({"where": "proxy", "reason": f"wait timeout {p} → {d}", "transfers": v})
    return pd.DataFrame(rows, columns=["where", "reason", "transfers"])


def buffer_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Each decoder's receive buffer now: bytes used of capacity, entries held, transfers being
    received, and transfers received and refused since start."""
    cols = {
        "used_bytes": total(frame, c.PD_BUFFER_USED, ("instance",)),
        "capacity_bytes": total(frame, c.PD_BUFFER_CAPACITY, ("instance",)),
        "entries": total(frame, c.PD_BUFFER_ENTRIES, ("instance",)),
        "receiving": total(frame, c.PD_IN_FLIGHT, ("instance",), side="receive"),
        "received": total(frame, c.PD_TRANSFERS, ("instance",), side="receive"),
        "refused or failed": total(frame, c.PD_FAILED_TRANSFERS, ("instance",), side="receive"),
    }
    table = pd.DataFrame(cols)
    if table.empty or table["capacity_bytes"].isna().all():
        return pd.DataFrame()
    table = table[table["capacity_bytes"].notna()]
    cap = table["capacity_bytes"]
    table.insert(2, "fill", (table["used_bytes"] / cap.where(cap > 0)).astype(float))
    table.index.name = "decoder"
    return table
