"""What a decoder's response and request log say of the tokens a prefiller sent.

Tokens a decoder loaded from its PD receive buffer are tokens KVLens supplied: they count in the
LMCache-compatible ``num_lmcache_cached_tokens``, in the ``kvlens`` breakdown (``hit_tokens``,
``loaded_tokens.pd``) and in the request log's line, and a request they served is no miss (the
tiers' lookup, which PD's came before, would say ``not_stored`` for a decoder without tiers).
A load that failed supplies nothing: those fields stay what the tiers said, and
``kvlens.pd.outcome`` says ``failed``.

Pure: neither vLLM nor torch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..engine.outcomes import RequestSummary

PD = "pd"  # the source's name in loaded_tokens


def received_tokens(pd: dict[str, Any] | None) -> int:
    """Prompt tokens the decoder loaded from what it received (0 unless the load loaded)."""
    if not pd or pd.get("role") != "receiver" or pd.get("outcome") != "loaded":
        return 0
    return int(pd.get("tokens") or 0)


def with_received(params: dict[str, Any], tokens: int) -> dict[str, Any]:
    """The response's ``kv_transfer_params`` counting ``tokens`` loaded from PD."""
    if tokens <= 0:
        return params
    out = dict(params)
    usage = dict(out.get("kvlens") or {})
    held = int(usage.get("vllm_cached_tokens") or 0) + tokens  # vLLM's own hit, then PD's records
    if "num_lmcache_cached_tokens" in out:
        out["num_lmcache_cached_tokens"] = max(int(out["num_lmcache_cached_tokens"] or 0), held)
    if "hit_tokens" in usage:
        usage["hit_tokens"] = max(int(usage["hit_tokens"] or 0), held)
    if "loaded_tokens" in usage or "hit_tokens" in usage:
        usage["loaded_tokens"] = {**(usage.get("loaded_tokens") or {}), PD: tokens}
    usage["miss_reason"] = None
    usage.pop("miss_detail", None)
    out["kvlens"] = usage
    return out


def summary_with_received(summary: RequestSummary, tokens: int) -> RequestSummary:
    """The request log's line counting ``tokens`` loaded from PD."""
    if tokens <= 0:
        return summary
    return replace(
        summary,
        loaded_tokens={**summary.loaded_tokens, PD: tokens},
        miss_reason=None,
        miss_detail=None,
    )
