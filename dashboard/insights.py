"""What the Insights view shows: tier sizing (what-if curves), which instances can share KV,
whether vLLM, KVLens's lookups and its loads agree, and whether KVLens saves more prefill time
than it spends. Plain pandas on the long sample frame of ``sources``, like ``views``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pandas as pd

from . import catalog as c
from . import palette
from .catalog import INFO_LABELS, kvlens
from .overview import prefill_cost_per_token, received
from .views import (
    DEFAULT_WINDOW_S,
    gauge,
    increase,
    join,
    rate,
    scalar,
    select,
    total,
)

CURRENT = 1.0  # the budget factor of a tier's configured size


# ---- what-if sizing -------------------------------------------------------------------------
def whatif_curves(frame: pd.DataFrame) -> pd.DataFrame:
    """The latest estimated hit ratio of each (instance, tier) at each budget factor: columns
    instance, tier, factor (float), ratio, series (the tier, with the instance when several)."""
    df = select(frame, kvlens("whatif_hit_ratio"))
    df = df[df["budget_factor"] != ""]
    if df.empty:
        return pd.DataFrame(columns=["instance", "tier", "factor", "ratio", "series"])
    last = df.sort_values("time").groupby(["instance", "tier", "budget_factor"], sort=False).tail(1)
    out = pd.DataFrame(
        {
            "instance": last["instance"],
            "tier": last["tier"],
            "factor": last["budget_factor"].astype(float),
            "ratio": last["value"].astype(float).clip(0.0, 1.0),
        }
    )
    several = out["instance"].nunique() > 1
    out["series"] = out["instance"] + " " + out["tier"] if several else out["tier"]
    return out.sort_values(["series", "factor"]).reset_index(drop=True)


def curve_of(curves: pd.DataFrame, series: str) -> dict[float, float]:
    one = curves[curves["series"] == series]
    return {float(f): float(r) for f, r in zip(one["factor"], one["ratio"], strict=True)}


def sizing_advice(curve: Mapping[float, float], tier: str) -> str | None:
    """The connector's one-line advice for a curve; None while the connector's what-if module
    is not installed, or for a curve without the configured size (factor 1) that it needs."""
    try:
        from connector.engine.whatif import sizing_advice as advise
    except ImportError:
        return None
    if CURRENT not in curve:
        return None
    return advise(dict(curve), tier)


# ---- which instances can share KV -----------------------------------------------------------
def storage_entries(storage: str) -> frozenset[str]:
    """``"disk:3f2a91c0,remote:redis://h:6379/0"`` -> its entries; ``""`` -> none."""
    return frozenset(e.strip() for e in storage.split(",") if e.strip())


def share_groups(info: pd.DataFrame) -> pd.DataFrame:
    """``info`` (index: instance; key_fingerprint, chunk_size, storage columns) with ``group``
    (instances linked, directly or through others, by equal key fingerprint and chunk size and
    a common storage entry), ``can share with`` (the instances linked directly) and ``alone``."""
    names = list(info.index)
    stores = {n: storage_entries(info.at[n, "storage"]) for n in names}
    key = {n: (info.at[n, "key_fingerprint"], info.at[n, "chunk_size"]) for n in names}
    peers = {
        n: sorted(m for m in names if m != n and key[m] == key[n] and stores[m] & stores[n]) for n in names
    }
    group: dict[str, int] = {}
    for n in names:  # connected components, numbered in instance order
        if n in group:
            continue
        number, todo = len(set(group.values())) + 1, [n]
        while todo:
            m = todo.pop()
            if m not in group:
                group[m] = number
                todo.extend(peers[m])
    out = info.copy()
    out["group"] = [group[n] for n in names]
    out["can share with"] = [", ".join(peers[n]) for n in names]
    out["alone"] = [not peers[n] for n in names]
    return out


INFO_COLUMNS = {
    "version": "version",
    "chunk_size": "chunk size",
    "key_fingerprint": "key fingerprint",
    "tiers": "tiers",
    "role": "role",
    "storage": "storage",
    "model_identity": "model identity",
    "quantization": "quantization",
    "kv_cache_dtype": "KV cache dtype",
    "pd_role": "PD role",
}


def instance_identity(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per instance from its latest ``vllm:kvlens_info`` series: what it runs, its
    tiers and storage, and which other instances it can share KV with."""
    df = select(frame, kvlens("info"))
    df = df[df["value"] > 0]
    if df.empty:
        return pd.DataFrame()
    last = df.sort_values("time").groupby("instance", sort=True).tail(1).set_index("instance").sort_index()
    info = share_groups(last[list(INFO_LABELS)])
    info.index.name = "instance"
    return info.rename(columns=INFO_COLUMNS)


# ---- reconciliation and time ----------------------------------------------------------------
def reconciliation(frame: pd.DataFrame, window_s: float = DEFAULT_WINDOW_S) -> pd.DataFrame:
    """Tokens per second vLLM counted as external hits, KVLens held at lookup, KVLens loaded:
    the three should move together (held >= external >= loaded, apart from vLLM's own hits). On
    a PD decoder vLLM's external hits also count what it received from a prefiller (its own line)."""
    return join(
        rate(frame, c.VLLM_EXTERNAL_HITS, window_s=window_s, legend="vLLM external hits"),
        rate(frame, kvlens("hit_tokens"), window_s=window_s, legend="KVLens held at lookup"),
        rate(frame, kvlens("load_tokens"), window_s=window_s, legend="KVLens loaded"),
        rate(frame, c.PD_LOADED_TOKENS, window_s=window_s, legend=palette.PD_RECEIVED)
        if received(frame)
        else pd.DataFrame(),
    )


def time_balance(frame: pd.DataFrame, window_s: float = DEFAULT_WINDOW_S) -> pd.DataFrame:
    """Seconds per second: prefill compute saved by tier against KVLens's own time by operation."""
    seconds = kvlens("operation_seconds", "_sum")
    return join(
        rate(frame, kvlens("prefill_seconds_saved"), ("tier",), window_s, prefix="saved, "),
        rate(frame, seconds, ("operation",), window_s, prefix="KVLens "),
    )


def prefill_cost(frame: pd.DataFrame) -> pd.DataFrame:
    """The engine's measured prefill seconds per token, one line per instance."""
    return gauge(frame, kvlens("prefill_seconds_per_token"), ("instance",))


@dataclass(frozen=True, slots=True)
class TimeBalance:
    """Prefill seconds KVLens saved and seconds it spent, since start and within the frame."""

    saved_s: float | None  # None: the connector does not export the estimate
    saved_s_window: float | None
    spent_s: float
    spent_s_window: float
    per_token_s: float | None  # mean of the engines' latest prefill cost per token

    @property
    def net_s(self) -> float | None:
        return None if self.saved_s is None else self.saved_s - self.spent_s


def balance(frame: pd.DataFrame) -> TimeBalance:
    saved_name, spent_name = kvlens("prefill_seconds_saved"), kvlens("operation_seconds", "_sum")
    exported = not select(frame, saved_name).empty
    return TimeBalance(
        saved_s=scalar(total(frame, saved_name)) if exported else None,
        saved_s_window=scalar(increase(frame, saved_name)) if exported else None,
        spent_s=scalar(total(frame, spent_name)),
        spent_s_window=scalar(increase(frame, spent_name)),
        per_token_s=prefill_cost_per_token(frame),
    )
