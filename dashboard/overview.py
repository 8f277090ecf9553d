"""The Overview's numbers: hit rates, where prompt tokens came from, what KVLens saved, and a
row per instance, computed from the long sample frame of ``sources``. Plain pandas, no
Streamlit."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from . import catalog as c
from .catalog import kvlens
from .views import (
    DEFAULT_WINDOW_S,
    for_instances,
    increase,
    instances,
    join,
    rate,
    ratio,
    scalar,
    select,
    total,
)


def hit_rates(frame: pd.DataFrame, window_s: float = DEFAULT_WINDOW_S) -> pd.DataFrame:
    def r(name: str, legend: str) -> pd.DataFrame:
        return rate(frame, name, window_s=window_s, legend=legend)

    return join(
        ratio(r(kvlens("hit_tokens"), "KVLens, tokens"), r(kvlens("lookup_tokens"), "KVLens, tokens")),
        ratio(
            r(kvlens("hit_requests"), "KVLens, requests"), r(kvlens("lookup_requests"), "KVLens, requests")
        ),
        ratio(
            r(c.VLLM_PREFIX_HITS, "vLLM prefix cache, tokens"),
            r(c.VLLM_PREFIX_QUERIES, "vLLM prefix cache, tokens"),
        ),
    )


def token_sources(frame: pd.DataFrame, window_s: float = DEFAULT_WINDOW_S) -> pd.DataFrame:
    """Prompt tokens per second by where their KV came from."""
    return join(
        rate(
            frame,
            c.VLLM_PROMPT_BY_SOURCE,
            window_s=window_s,
            legend="vLLM prefix cache",
            source="local_cache_hit",
        ),
        rate(frame, kvlens("load_tokens"), ("tier",), window_s, prefix="KVLens "),
        rate(frame, c.VLLM_PROMPT_BY_SOURCE, window_s=window_s, legend="computed", source="local_compute"),
    )


def token_totals(frame: pd.DataFrame) -> pd.Series:
    """Prompt tokens since each server started, by where their KV came from."""
    parts = {"vLLM prefix cache": scalar(total(frame, c.VLLM_PROMPT_BY_SOURCE, source="local_cache_hit"))}
    for tier, v in total(frame, kvlens("load_tokens"), ("tier",)).items():
        parts[f"KVLens {tier}"] = float(v)
    parts["computed"] = scalar(total(frame, c.VLLM_PROMPT_BY_SOURCE, source="local_compute"))
    return pd.Series(parts, dtype=float)


@dataclass(frozen=True, slots=True)
class Savings:
    """What KVLens saved, since the servers started (totals) and within the frame (window)."""

    lookup_tokens: float
    hit_tokens: float
    loaded_tokens: float
    loaded_tokens_window: float
    prefill_s_per_token: float | None  # the engines' measured prefill seconds per token
    failed_loads: float
    recomputed_tokens: float
    connector_seconds_saved: float | None = None  # vllm:kvlens_prefill_seconds_saved, when exported
    connector_seconds_saved_window: float | None = None

    @property
    def hit_rate(self) -> float | None:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens > 0 else None

    @property
    def seconds_saved(self) -> float | None:
        """The connector's estimate when it exports one, else tokens KVLens loaded times the
        engines' measured cost of computing a token."""
        if self.connector_seconds_saved is not None:
            return self.connector_seconds_saved
        per = self.prefill_s_per_token
        return None if per is None else self.loaded_tokens * per

    @property
    def seconds_saved_window(self) -> float | None:
        if self.connector_seconds_saved_window is not None:
            return self.connector_seconds_saved_window
        per = self.prefill_s_per_token
        return None if per is None else self.loaded_tokens_window * per


def prefill_cost_per_token(frame: pd.DataFrame) -> float | None:
    """The mean of the engines' latest measured prefill seconds per token (KVLens times whole
    engine steps). Not vLLM's per-request prefill times over computed tokens: requests batched
    into one step each count that step's whole time, which overstates the cost."""
    latest = select(frame, kvlens("prefill_seconds_per_token")).sort_values("time")
    per_token = latest.groupby(["instance", "engine"]).tail(1)["value"].astype(float)
    return float(per_token.mean()) if not per_token.empty else None


def savings(frame: pd.DataFrame) -> Savings:
    saved = kvlens("prefill_seconds_saved")
    exported = not select(frame, saved).empty
    return Savings(
        lookup_tokens=scalar(total(frame, kvlens("lookup_tokens"))),
        hit_tokens=scalar(total(frame, kvlens("hit_tokens"))),
        loaded_tokens=scalar(total(frame, kvlens("load_tokens"))),
        loaded_tokens_window=scalar(increase(frame, kvlens("load_tokens"))),
        prefill_s_per_token=prefill_cost_per_token(frame),
        failed_loads=scalar(total(frame, kvlens("failed_load_requests"))),
        recomputed_tokens=scalar(total(frame, kvlens("recomputed_tokens"))),
        connector_seconds_saved=scalar(total(frame, saved)) if exported else None,
        connector_seconds_saved_window=scalar(increase(frame, saved)) if exported else None,
    )


def instance_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per instance, numbers since its server started."""
    rows = []
    for inst in instances(frame):
        s = savings(for_instances(frame, [inst]))
        rows.append(
            {
                "instance": inst,
                "KVLens hit rate": s.hit_rate,
                "tokens loaded by KVLens": s.loaded_tokens,
                "prefill time saved (est., s)": s.seconds_saved,
                "requests with failed loads": s.failed_loads,
                "tokens recomputed": s.recomputed_tokens,
            }
        )
    return pd.DataFrame(rows).set_index("instance") if rows else pd.DataFrame()
