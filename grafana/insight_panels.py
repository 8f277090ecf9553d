"""The Insights row: tier sizing (what-if curves), which instances can share KV, whether vLLM,
KVLens's lookups and its loads agree, and prefill time saved against KVLens's own time."""

from __future__ import annotations

from dashboard import palette

from .panel_types import STAT, TABLE, TOKENS_PER_S, TREND, Panel, Target, increase_sum, rate_sum

ROW = "Insights"

_WHATIF = "avg by (tier, budget_factor) (vllm:kvlens_whatif_hit_ratio{budget_factor!=''})"
_AT_CONFIGURED_SIZE = (
    "label_replace(avg by (tier, budget_factor) (vllm:kvlens_whatif_hit_ratio{budget_factor='1'}), "
    "'tier', '$1 (configured size)', 'tier', '(.*)')"
)
_INFO = "vllm:kvlens_info"
_IDENTITY = (
    "version, chunk_size, key_fingerprint, tiers, role, storage, model_identity, quantization, kv_cache_dtype"
)


def _sharing(kind: str) -> str:
    """Per instance: how many instances (itself included) with its key fingerprint and chunk
    size report the same ``kind`` entry ("disk:…", "remote:…") in their storage label."""
    entry = (
        f"max by (instance, key_fingerprint, chunk_size, {kind}) (label_replace("
        f"{_INFO}{{storage=~'.*{kind}:.*'}}, '{kind}', '$1', 'storage', '(?:.*,)?({kind}:.*?)(?:,.*)?'))"
    )
    peers = f"count by (key_fingerprint, chunk_size, {kind}) ({entry})"
    return f"max by (instance) ({entry} * on (key_fingerprint, chunk_size, {kind}) group_left () {peers})"


# Others each instance can share KV with: the larger of those sharing its disk or its remote
# store (0 for an instance without either).
_SHARE_WITH = (
    "max by (instance) (\n"
    f"  label_replace({_sharing('disk')}, 'via', 'disk', '', '')\n"
    f"  or label_replace({_sharing('remote')}, 'via', 'remote', '', '')\n"
    f"  or label_replace(max by (instance) ({_INFO}), 'via', 'none', '', '')\n"
    ") - 1"
)
_SHARE_COLUMN = "others it can share with"

INSIGHT_PANELS: tuple[Panel, ...] = (
    Panel(
        ROW,
        "Tier sizing: hit ratio at other budgets",
        "percentunit",
        (Target(_WHATIF, "{{tier}}"), Target(_AT_CONFIGURED_SIZE, "{{tier}}")),
        "Estimated token hit ratio each tier would have at 1/8 to 16 times its configured size "
        "(x axis, log2; the big dot is the configured size), averaged over the selected instances: "
        "pick one instance for its own curve. A curve still rising right of 1 says a larger budget pays.",
        kind=TREND,
        width=12,
        height=9,
        ratio=True,
        transformations=(
            {"id": "joinByLabels", "options": {"value": "tier", "join": ["budget_factor"]}},
            {
                "id": "convertFieldType",
                "options": {"conversions": [{"targetField": "budget_factor", "destinationType": "number"}]},
            },
            {"id": "sortBy", "options": {"sort": [{"field": "budget_factor"}]}},
        ),
        x_field="budget_factor",
        log2_x=True,
        overrides=(
            (
                ".*configured size.*",
                {"custom.showPoints": "always", "custom.pointSize": 12, "custom.lineWidth": 0},
            ),
        ),
    ),
    Panel(
        ROW,
        "Instances and who can share KV",
        "short",
        (
            Target(f"max by (instance, job, {_IDENTITY}) ({_INFO})"),
            Target(_SHARE_WITH),
        ),
        "One row per instance from vllm:kvlens_info. Two instances can share KV only with equal key "
        "fingerprint and chunk size and a common storage location; 'others it can share with' counts "
        "those sharing its disk or its remote store (the larger of the two); 'alone': none.",
        kind=TABLE,
        width=12,
        height=9,
        transformations=(
            {"id": "merge", "options": {}},
            {
                "id": "organize",
                "options": {
                    "excludeByName": {"Time": True, "Value #A": True},
                    "renameByName": {
                        "chunk_size": "chunk size",
                        "key_fingerprint": "key fingerprint",
                        "model_identity": "model identity",
                        "kv_cache_dtype": "KV cache dtype",
                        "Value #B": _SHARE_COLUMN,
                    },
                },
            },
        ),
        overrides=(
            (
                _SHARE_COLUMN,
                {
                    "mappings": [
                        {"type": "value", "options": {"0": {"text": "alone", "color": "red", "index": 0}}}
                    ],
                    "custom.cellOptions": {"type": "color-text"},
                },
            ),
        ),
    ),
    Panel(
        ROW,
        "Reconciliation: vLLM external hits, KVLens held, KVLens loaded",
        TOKENS_PER_S,
        (
            Target(rate_sum("vllm:external_prefix_cache_hits_total"), "vLLM external hits"),
            Target(rate_sum("vllm:kvlens_hit_tokens_total"), "KVLens held at lookup"),
            Target(rate_sum("vllm:kvlens_load_tokens_total"), "KVLens loaded"),
            Target(rate_sum("vllm:kvlens_pd_loaded_tokens_total"), palette.PD_RECEIVED),
        ),
        "vLLM external hits: tokens vLLM asked KVLens to load. Held at lookup: tokens KVLens had, "
        "including those vLLM's own cache already held. Loaded: what arrived. Loaded well below vLLM's "
        "external hits means loads went missing or failed (alert KVLensLoadedTokensDrift). On a PD "
        "decoder vLLM's external hits also count what it received from a prefiller (PD), loaded from "
        "its receive buffer: compare them with loaded plus received.",
        width=12,
    ),
    Panel(
        ROW,
        "Prefill time saved vs KVLens's own time",
        "suffix: s/s",
        (
            Target(rate_sum("vllm:kvlens_prefill_seconds_saved_total", by="tier"), "saved, {{tier}}"),
            Target(rate_sum("vllm:kvlens_operation_seconds_sum", by="operation"), "KVLens {{operation}}"),
        ),
        "Seconds per second: the connector's estimate of prefill compute saved by the tokens each tier "
        "loaded, against the time KVLens spent in lookups, loads and stores (alert "
        "KVLensCacheCostsMoreThanItSaves).",
        width=12,
    ),
    Panel(
        ROW,
        "Prefill time saved (connector)",
        "s",
        (Target(increase_sum("vllm:kvlens_prefill_seconds_saved_total")),),
        "The connector's estimate of prefill compute saved over the time range.",
        kind=STAT,
        width=6,
    ),
    Panel(
        ROW,
        "KVLens time spent",
        "s",
        (Target(increase_sum("vllm:kvlens_operation_seconds_sum")),),
        "Seconds KVLens spent in lookups, loads and stores over the time range.",
        kind=STAT,
        width=6,
    ),
    Panel(
        ROW,
        "Net prefill time saved",
        "s",
        (
            Target(
                f"{increase_sum('vllm:kvlens_prefill_seconds_saved_total')}\n"
                f"- on ()\n{increase_sum('vllm:kvlens_operation_seconds_sum')}"
            ),
        ),
        "Saved minus spent over the time range: below zero KVLens costs more than it saves. No value "
        "until the engine has measured what a prefill token costs (unknown, not zero).",
        kind=STAT,
        width=6,
    ),
    Panel(
        ROW,
        "Prefill cost per token",
        "s",
        (Target("avg (vllm:kvlens_prefill_seconds_per_token)"),),
        "The engine's measured prefill seconds per token (mean over the selected instances): what each "
        "token KVLens loads is worth.",
        kind=STAT,
        width=6,
    ),
)
