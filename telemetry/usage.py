"""What KVLens did for one request, as returned in the response's ``kv_transfer_params``.

Built when the lookup becomes final, completed by the workers' load report, and turned into
the ``kvlens`` object of ``kv_transfer_params`` when the request finishes. No prompt text and
no token ids: counts, tiers, times and reason names only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PARAMS_KEY = "kvlens"


@dataclass(slots=True)
class RequestUsage:
    prompt_tokens: int
    vllm_cached_tokens: int  # tokens vLLM's own prefix cache had
    hit_tokens: int  # tokens KVLens held for the prompt
    planned_tokens: int  # tokens KVLens was to load (0: no load)
    miss_reason: str | None
    save_skip_reason: str | None
    loaded_tokens: dict[str, int] = field(default_factory=dict)  # by tier
    load_seconds: float = 0.0
    failed_blocks: int = 0
    recomputed_tokens: int = 0
    load_reported: bool = False

    @property
    def load_pending(self) -> bool:
        return self.planned_tokens > 0 and not self.load_reported

    def record_load(self, tokens_by_tier: dict[str, int], seconds: float, failed_blocks: int) -> int:
        """Merge one load outcome; returns the tokens vLLM must recompute because of it."""
        for tier, n in tokens_by_tier.items():
            self.loaded_tokens[tier] = self.loaded_tokens.get(tier, 0) + n
        self.load_seconds += seconds
        self.failed_blocks += failed_blocks
        self.load_reported = True
        if not failed_blocks:
            return 0
        affected = max(self.planned_tokens - sum(tokens_by_tier.values()), 0)
        self.recomputed_tokens += affected
        return affected

    def to_params(self) -> dict[str, Any]:
        return {
            "vllm_cached_tokens": self.vllm_cached_tokens,
            "hit_tokens": self.hit_tokens,
            "loaded_tokens": dict(self.loaded_tokens),
            "load_ms": round(self.load_seconds * 1000, 3),
            "failed_blocks": self.failed_blocks,
            "recomputed_tokens": self.recomputed_tokens,
            "miss_reason": self.miss_reason,
            "save_skip_reason": self.save_skip_reason,
        }
