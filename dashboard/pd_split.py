"""Where a PD request's time to first token goes, from ``kvlens pd-proxy``: its phase histogram
(``kvlens_pd_proxy_phase_seconds{phase, prefiller, decoder}``, in the long sample frame of
``sources``) and its per-request records (``dashboard.pd_records``). Plain pandas, no Streamlit.

The proxy times each phase for the requests that reach it: ``prefill`` for every request it sent
to a prefiller, ``transfer_wait`` for those it then sent on to a decoder, ``decode_first_token``
and ``ttft`` for streamed ones only (a request answered whole has no first token to time). Means
of different phases are then means over different requests, and do not add up to the time to
first token. A split is therefore computed over one set of requests, the streamed ones that
reached their first token, and its parts add up to their time to first token: ``proxy
(tokenize, relay)`` is what the proxy spent between the phases (the tokenizer's answer, the
first chunks relayed to the client).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from . import catalog as c
from . import palette
from .views import DEFAULT_WINDOW_S, join, rate, ratio, total

PAIR = ("prefiller", "decoder")
GROUPINGS = {"pair": PAIR, "prefiller": ("prefiller",), "decoder": ("decoder",)}
PHASE_COLUMNS = tuple(palette.PHASE_LABELS[p] for p in c.PD_PHASES)
SPLIT_COLUMNS = (*PHASE_COLUMNS, palette.PROXY)  # the parts, in order: they add up to the TTFT
TTFT = palette.TTFT
REQUESTS = "requests"
_ROUNDING = 1e-9  # seconds: below this, the rest of the TTFT is the sums' rounding


@dataclass(frozen=True, slots=True)
class Split:
    """Per group (a pair, a prefiller or a decoder): the mean seconds of each part of the time to
    first token, the mean time to first token and the requests, all over ``population``."""

    table: pd.DataFrame  # columns SPLIT_COLUMNS, TTFT, REQUESTS; index: the group
    population: str  # which requests, in words ("" when there are none)


def _group_index(index: pd.Index, by: tuple[str, ...]) -> pd.Index:
    if len(by) > 1:
        return pd.Index([" → ".join(k) for k in index], name=" → ".join(by))
    return pd.Index(list(index), name=by[0])


def _with_proxy_part(means: pd.DataFrame) -> pd.DataFrame:
    """The parts in order, the proxy's share being the rest of the time to first token."""
    out = means[list(PHASE_COLUMNS)].copy()
    rest = means[TTFT] - out.sum(axis=1, min_count=len(PHASE_COLUMNS))
    out[palette.PROXY] = rest.mask(rest.abs() <= _ROUNDING, 0.0)  # not -2e-16 s from float sums
    out[TTFT] = means[TTFT]
    out[REQUESTS] = means[REQUESTS]
    return out.sort_values(REQUESTS, ascending=False)


def phase_counts(proxy: pd.DataFrame, by: tuple[str, ...] = PAIR) -> pd.DataFrame:
    """Per group, how many requests the proxy timed in each phase (its label values as columns)."""
    counts = total(proxy, c.PROXY_PHASE + "_count", (*by, "phase"))
    return counts.unstack("phase").fillna(0) if not counts.empty else pd.DataFrame()


def one_population(counts: pd.DataFrame) -> bool:
    """Whether every phase was timed for the same requests: as many prefills, transfer waits,
    first tokens and times to first token, in every group (no request answered whole, none
    ended early). Each phase is timed only after the one before it, so equal counts are the
    same requests."""
    phases = [*c.PD_PHASES, c.PD_TTFT]
    if counts.empty or any(p not in counts.columns for p in phases):
        return False
    first = counts[phases[0]]
    return bool((first > 0).all()) and all(bool((counts[p] == first).all()) for p in phases)


def from_histogram(proxy: pd.DataFrame, by: tuple[str, ...] = PAIR) -> Split | None:
    """The split since the proxy started, when every phase was timed for the same requests."""
    counts = phase_counts(proxy, by)
    if not one_population(counts):
        return None
    sums = total(proxy, c.PROXY_PHASE + "_sum", (*by, "phase")).unstack("phase")
    means = pd.DataFrame(index=counts.index)
    for phase, column in zip(c.PD_PHASES, PHASE_COLUMNS, strict=True):
        means[column] = sums[phase] / counts[phase]
    means[TTFT] = sums[c.PD_TTFT] / counts[c.PD_TTFT]
    means[REQUESTS] = counts[c.PD_TTFT]
    means.index = _group_index(means.index, by)
    n = int(means[REQUESTS].sum())
    return Split(
        _with_proxy_part(means), f"all {n:,} requests the proxy timed since it started (all streamed)"
    )


def from_records(records: pd.DataFrame, by: tuple[str, ...] = PAIR) -> Split:
    """The split over the streamed requests among the proxy's newest records that reached their
    first token (every phase and the time to first token timed)."""
    timed = records.dropna(subset=["ttft_ms", *PHASE_COLUMNS, *by]) if not records.empty else records
    if timed.empty:
        columns = [*SPLIT_COLUMNS, TTFT, REQUESTS]
        return Split(pd.DataFrame(columns=columns, index=pd.Index([], name=" → ".join(by))), "")
    grouped = timed.groupby(list(by), sort=False)
    means = grouped[list(PHASE_COLUMNS)].mean() / 1e3
    means[TTFT] = grouped["ttft_ms"].mean() / 1e3
    means[REQUESTS] = grouped.size().astype(float)
    means.index = _group_index(means.index, by)
    population = (
        f"the {len(timed):,} streamed requests among the proxy's newest {len(records):,} records "
        "that reached their first token"
    )
    return Split(_with_proxy_part(means), population)


def split(proxy: pd.DataFrame, records: pd.DataFrame, by: tuple[str, ...] = PAIR) -> Split:
    """Where the time to first token goes, per group, over one set of requests: every request
    since the proxy started when the proxy timed every phase for all of them, else the streamed
    ones among its newest records."""
    return from_histogram(proxy, by) or from_records(records, by)


def mixed_note(proxy: pd.DataFrame, records_read: bool) -> str:
    """Why there is no split: nothing timed yet, or phases timed for different requests and no
    streamed request among the records (or no records read)."""
    counts = total(proxy, c.PROXY_PHASE + "_count", ("phase",))
    if counts.empty or counts.sum() == 0:
        return "No PD request timed by the proxy yet."
    timed = ", ".join(
        f"{palette.PHASE_LABELS.get(p, TTFT)} {int(counts.get(p, 0)):,}" for p in (*c.PD_PHASES, c.PD_TTFT)
    )
    where = (
        "and none of its newest records is a streamed request that reached its first token"
        if records_read
        else "start the app with --pd-proxy to split the streamed ones among its newest records"
    )
    return (
        f"No split: the proxy timed its phases for different requests ({timed}; a request "
        f"answered whole, not streamed, has no first token), {where}."
    )


def phases_over_time(proxy: pd.DataFrame, window_s: float = DEFAULT_WINDOW_S) -> pd.DataFrame:
    """In each window, all pairs together, the mean seconds of each phase over the requests that
    reached it, and the mean time to first token (streamed requests): lines, not a stack, since
    their requests differ."""
    sums = rate(proxy, c.PROXY_PHASE + "_sum", ("phase",), window_s)
    counts = rate(proxy, c.PROXY_PHASE + "_count", ("phase",), window_s)
    mean = ratio(sums, counts)
    order = [p for p in (*c.PD_PHASES, c.PD_TTFT) if p in mean.columns]
    return join(mean[order]).rename(columns={**palette.PHASE_LABELS, c.PD_TTFT: TTFT})
