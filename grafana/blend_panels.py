"""The Blending row (``enable_blending``): what blended requests reused and recomputed, how many
failed over to a full prefill, and the deviation that chose the recomputed tokens."""

from __future__ import annotations

from .panel_types import TOKENS_PER_S, Panel, Target, quantile, rate_sum, ratio

ROW = "Blending"

BLEND_PANELS: tuple[Panel, ...] = (
    Panel(
        ROW,
        "Blended prompt tokens",
        TOKENS_PER_S,
        (
            Target(
                rate_sum("vllm:kvlens_blend_tokens_total", matchers='kind="reused"'), "reused (from a tier)"
            ),
            Target(
                rate_sum("vllm:kvlens_blend_tokens_total", matchers='kind="recomputed_by_deviation"'),
                "recomputed: deviated most",
            ),
            Target(
                rate_sum("vllm:kvlens_blend_tokens_total", matchers='kind="not_stored"'),
                "computed: not stored",
            ),
        ),
        "Tokens per second of blended prompts: reused from a tier (moved to their new positions), reused "
        "ones recomputed because their K deviated most at the check layer, and tokens no stored chunk "
        "supplied (separators, the question, short or new segments). Reused minus recomputed is what "
        "blending saved over a full prefill.",
        needs_blend=True,
    ),
    Panel(
        ROW,
        "Recomputed share",
        "percentunit",
        (
            Target(
                ratio(
                    rate_sum("vllm:kvlens_blend_tokens_total", matchers='kind="recomputed"'),
                    rate_sum("vllm:kvlens_blend_tokens_total", matchers='kind=~"reused|not_stored"'),
                ),
                "all blended tokens",
            ),
            Target(quantile(0.9, "vllm:kvlens_blend_recomputed_ratio_bucket"), "p90 per request"),
        ),
        "Share of blended prompts' tokens the blend computed (what it cost), over all of them and the 90th "
        "percentile per request.",
        ratio=True,
        needs_blend=True,
    ),
    Panel(
        ROW,
        "Blended requests",
        "reqps",
        (Target(rate_sum("vllm:kvlens_blend_requests_total", by="outcome"), "{{outcome}}"),),
        "Requests blended per second; failed: the blend could not run (no model remembered, a model the "
        "blender does not know) and vLLM computed the prompt itself (logged, and on the kvlens.blend span).",
        stack=True,
        needs_blend=True,
    ),
    Panel(
        ROW,
        "Blending by tenant",
        TOKENS_PER_S,
        (
            Target(
                rate_sum("vllm:kvlens_tenant_blend_tokens_total", by="tenant", matchers='kind="reused"'),
                "{{tenant}} reused",
            ),
            Target(
                rate_sum("vllm:kvlens_tenant_blend_tokens_total", by="tenant", matchers='kind="recomputed"'),
                "{{tenant}} recomputed",
            ),
        ),
        "Per tenant (cache salt or tags, as ids; see the Tenants row), tokens per second of blended prompts "
        "reused from a tier (what blending saved) and computed by the blend (what it cost).",
        needs_blend=True,
    ),
    Panel(
        ROW,
        "Deviation at the check layer",
        "none",
        (
            Target(quantile(0.5, "vllm:kvlens_blend_deviation_bucket"), "p50"),
            Target(quantile(0.9, "vllm:kvlens_blend_deviation_bucket"), "p90"),
        ),
        "Per blended request, the mean K deviation of its reused tokens at the first check layer "
        "(squared L2 over heads and head size): rising values mean stored segments fit their new "
        "contexts worse.",
        needs_blend=True,
    ),
)
