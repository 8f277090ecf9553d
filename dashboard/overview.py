"""The Overview's numbers: hit rates, where prompt tokens came from, what KVLens saved, and a
row per instance, computed from the long sample frame of ``sources``. Plain pandas, no
Streamlit."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from . import catalog as c
from . import palette
from .catalog import kvlens
from .pd import ROLE_NAMES
from .pd import roles as pd_roles
from .views import (
    DEFAULT_WINDOW_S,
    added,
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

# The legends of the Overview's two hit rates.
TOKENS, REQUESTS = "KVLens, tokens", "KVLens, requests"


def hit_rates(frame: pd.DataFrame, window_s: float = DEFAULT_WINDOW_S) -> pd.DataFrame:
    """Share of looked-up prompt tokens (and requests) KVLens supplied: held in a tier at lookup,
    or on a PD decoder received from a prefiller; and vLLM's own prefix cache hit rate."""

    def r(name: str, legend: str, **labels: str) -> pd.DataFrame:
        return rate(frame, name, window_s=window_s, legend=legend, **labels)

    held = added(r(kvlens("hit_tokens"), TOKENS), r(c.PD_LOADED_TOKENS, TOKENS))
    hit = added(r(kvlens("hit_requests"), REQUESTS), r(c.PD_LOADS, REQUESTS, outcome="loaded"))
    return join(
        _at_most_one(ratio(held, r(kvlens("lookup_tokens"), TOKENS))),
        _at_most_one(ratio(hit, r(kvlens("lookup_requests"), REQUESTS))),
        ratio(
            r(c.VLLM_PREFIX_HITS, "vLLM prefix cache, tokens"),
            r(c.VLLM_PREFIX_QUERIES, "vLLM prefix cache, tokens"),
        ),
    )


def _at_most_one(share: pd.DataFrame) -> pd.DataFrame:
    """A decoder with a tier of its own may count a prefix both held in the tier and received:
    a share of prompt tokens is never above 1."""
    return share.clip(upper=1.0)


def received(frame: pd.DataFrame) -> bool:
    """Whether a decoder loaded prompt tokens a prefiller sent (every engine exports the series,
    at 0 where PD is off: a source shown only where it supplied something)."""
    return scalar(total(frame, c.PD_LOADED_TOKENS)) > 0


def token_sources(frame: pd.DataFrame, window_s: float = DEFAULT_WINDOW_S) -> pd.DataFrame:
    """Prompt tokens per second by where their KV came from: vLLM's prefix cache, each KVLens
    tier, a prefiller (on a PD decoder: loaded from what the prefiller sent), or computed."""
    pd_part = (
        rate(frame, c.PD_LOADED_TOKENS, window_s=window_s, legend=palette.PD_RECEIVED)
        if received(frame)
        else pd.DataFrame()
    )
    return join(
        rate(
            frame,
            c.VLLM_PROMPT_BY_SOURCE,
            window_s=window_s,
            legend=palette.VLLM_PREFIX_CACHE,
            source="local_cache_hit",
        ),
        rate(frame, kvlens("load_tokens"), ("tier",), window_s, prefix="KVLens "),
        pd_part,
        rate(
            frame, c.VLLM_PROMPT_BY_SOURCE, window_s=window_s, legend=palette.COMPUTED, source="local_compute"
        ),
    )


def token_totals(frame: pd.DataFrame) -> pd.Series:
    """Prompt tokens since each server started, by where their KV came from."""
    parts = {
        palette.VLLM_PREFIX_CACHE: scalar(total(frame, c.VLLM_PROMPT_BY_SOURCE, source="local_cache_hit"))
    }
    for tier, v in total(frame, kvlens("load_tokens"), ("tier",)).items():
        parts[f"KVLens {tier}"] = float(v)
    if received(frame):
        parts[palette.PD_RECEIVED] = scalar(total(frame, c.PD_LOADED_TOKENS))
    parts[palette.COMPUTED] = scalar(total(frame, c.VLLM_PROMPT_BY_SOURCE, source="local_compute"))
    return pd.Series(parts, dtype=float)


@dataclass(frozen=True, slots=True)
class Savings:
    """What KVLens saved, since the servers started (totals) and within the frame (window)."""

    lookup_tokens: float
    hit_tokens: float
    loaded_tokens: float  # from KVLens's tiers
    loaded_tokens_window: float
    prefill_s_per_token: float | None  # the engines' measured prefill seconds per token
    failed_loads: float
    recomputed_tokens: float
    connector_seconds_saved: float | None = None  # vllm:kvlens_prefill_seconds_saved, when exported
    connector_seconds_saved_window: float | None = None
    pd_loaded_tokens: float = 0.0  # on a PD decoder: loaded from what a prefiller sent
    pd_loaded_tokens_window: float = 0.0

    @property
    def supplied_tokens(self) -> float:
        """Prompt tokens KVLens loaded into vLLM: from its tiers, and received from a prefiller."""
        return self.loaded_tokens + self.pd_loaded_tokens

    @property
    def supplied_tokens_window(self) -> float:
        return self.loaded_tokens_window + self.pd_loaded_tokens_window

    @property
    def hit_rate(self) -> float | None:
        """Share of looked-up prompt tokens KVLens held in a tier or received from a prefiller."""
        if self.lookup_tokens <= 0:
            return None
        return min((self.hit_tokens + self.pd_loaded_tokens) / self.lookup_tokens, 1.0)

    @property
    def seconds_saved(self) -> float | None:
        """The connector's estimate when it exports one, else tokens KVLens loaded from its tiers
        times the engines' measured cost of computing a token. Tokens received from a prefiller
        save nothing here: their prefill ran on the prefiller."""
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
        pd_loaded_tokens=scalar(total(frame, c.PD_LOADED_TOKENS)),
        pd_loaded_tokens_window=scalar(increase(frame, c.PD_LOADED_TOKENS)),
    )


def instance_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per instance, numbers since its server started; with PD, each instance's role and
    the prompt tokens a decoder received from a prefiller (counted in what KVLens loaded)."""
    roles = pd_roles(frame)
    with_pd = bool(roles) or received(frame)
    rows = []
    for inst in instances(frame):
        s = savings(for_instances(frame, [inst]))
        row: dict[str, object] = {"instance": inst}
        if with_pd:
            row["PD role"] = ROLE_NAMES.get(roles.get(inst, ""), "")
        row["KVLens hit rate"] = s.hit_rate
        row["tokens loaded by KVLens"] = s.supplied_tokens
        if with_pd:
            row[RECEIVED_COLUMN] = s.pd_loaded_tokens
        row["prefill time saved (est., s)"] = s.seconds_saved
        row["requests with failed loads"] = s.failed_loads
        row["tokens recomputed"] = s.recomputed_tokens
        rows.append(row)
    return pd.DataFrame(rows).set_index("instance") if rows else pd.DataFrame()


RECEIVED_COLUMN = "of them " + palette.PD_RECEIVED
