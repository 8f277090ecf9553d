"""The Tenants row: hit ratio, tokens loaded and bytes held per tenant (a cache salt or a tag
set, labelled by a short keyed hash that never carries the salt; ``default``: neither;
``other``: tenants beyond the engine's ``tenant_labels_max``)."""

from __future__ import annotations

from .panel_types import TOKENS_PER_S, Panel, Target, rate_sum, ratio

ROW = "Tenants"

_ABOUT = (
    " A tenant is a cache salt or a set of key tags (lmcache.tag.*), shown as salt:<id> or "
    "<tag name>:<id>, never the value; default: requests with neither; other: tenants after the "
    "engine's first extra_config.tenant_labels_max."
)

TENANT_PANELS: tuple[Panel, ...] = (
    Panel(
        ROW,
        "Hit ratio per tenant",
        "percentunit",
        (
            Target(
                ratio(
                    rate_sum("vllm:kvlens_tenant_hit_tokens_total", by="tenant"),
                    rate_sum("vllm:kvlens_tenant_lookup_tokens_total", by="tenant"),
                ),
                "{{tenant}}",
            ),
        ),
        "Share of each tenant's prompt tokens KVLens held at lookup (its responses' "
        "num_lmcache_cached_tokens over their prompt tokens)." + _ABOUT,
        ratio=True,
    ),
    Panel(
        ROW,
        "Tokens loaded per tenant",
        TOKENS_PER_S,
        (Target(rate_sum("vllm:kvlens_tenant_load_tokens_total", by="tenant"), "{{tenant}}"),),
        "Tokens per second whose KV KVLens loaded into vLLM, per tenant." + _ABOUT,
        stack=True,
    ),
    Panel(
        ROW,
        "Bytes held per tenant",
        "bytes",
        (Target("sum by (tenant, tier) (vllm:kvlens_tenant_bytes)", "{{tenant}} {{tier}}"),),
        "Bytes each tenant's chunks hold in each tier (one rank's share; chunks this engine stored or "
        "promoted: chunks other engines wrote to a shared disk directory are not attributed)." + _ABOUT,
        stack=True,
    ),
)
