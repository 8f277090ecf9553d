"""The Tenants tab's numbers: hit ratio, tokens loaded and bytes held per tenant (a cache salt
or a tag set, shown by KVLens as a short id that never carries the salt; ``default``: neither;
``other``: tenants beyond the engine's ``tenant_labels_max``). Plain pandas, no Streamlit."""

from __future__ import annotations

import pandas as pd

from .catalog import kvlens
from .views import DEFAULT_WINDOW_S, gauge, rate, ratio, select, total

LOOKUP = kvlens("tenant_lookup_tokens")
HIT = kvlens("tenant_hit_tokens")
LOAD = kvlens("tenant_load_tokens")
BYTES = kvlens("tenant_bytes")


def has_tenants(frame: pd.DataFrame) -> bool:
    """Whether any instance exports the per-tenant series (older KVLens versions do not)."""
    return not select(frame, LOOKUP).empty


def hit_ratios(frame: pd.DataFrame, window_s: float = DEFAULT_WINDOW_S) -> pd.DataFrame:
    """Per tenant, the share of its prompt tokens KVLens held (missing where it looked up none)."""
    return ratio(
        rate(frame, HIT, ("tenant",), window_s),
        rate(frame, LOOKUP, ("tenant",), window_s),
    )


def loaded(frame: pd.DataFrame, window_s: float = DEFAULT_WINDOW_S) -> pd.DataFrame:
    """Tokens per second KVLens loaded into vLLM, per tenant."""
    return rate(frame, LOAD, ("tenant",), window_s)


def bytes_held(frame: pd.DataFrame) -> pd.DataFrame:
    """Bytes each tenant's chunks hold, per tenant and tier (one rank's share, all instances)."""
    return gauge(frame, BYTES, ("tenant", "tier"))


def table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per tenant: tokens looked up, held and loaded since start, the hit ratio, and the
    bytes held now per tier; the busiest tenants first."""
    looked_up = total(frame, LOOKUP, ("tenant",))
    if looked_up.empty:
        return pd.DataFrame()
    out = pd.DataFrame(
        {
            "looked up (tokens)": looked_up,
            "held (tokens)": total(frame, HIT, ("tenant",)),
            "loaded (tokens)": total(frame, LOAD, ("tenant",)),
        }
    ).fillna(0)
    den = out["looked up (tokens)"]
    out.insert(2, "hit ratio", (out["held (tokens)"] / den.where(den > 0)))
    held = total(frame, BYTES, ("tenant", "tier"))
    if not held.empty:
        for tier, per_tenant in held.groupby(level="tier"):
            out[f"bytes held ({tier})"] = per_tenant.droplevel("tier").reindex(out.index).fillna(0)
    out.index.name = "tenant"
    return out.sort_values("looked up (tokens)", ascending=False)
