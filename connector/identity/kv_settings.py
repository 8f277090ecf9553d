"""Engine settings that change the values of a model's KV, beyond its weights and HF config.

Found by walking vLLM 0.32's model, rotary-embedding and attention code for inputs other than
the weights and ``model_config.hf_config`` (which already carries ``hf_overrides``, rope
overrides and ``--disable-sliding-window``, and is digested whole). Each entry is present only
where it changes the KV, so engines that differ in a setting that does not (``max_model_len``
of a plain-RoPE model) still share. Reads vLLM's config objects by attribute; no vLLM import.
"""

from __future__ import annotations

from typing import Any

# Architectures whose rotary embedding is built for max(min)(config, max_model_len) positions
# (vLLM 0.32 minimax_m2.py, plamo3.py): with a scaled rope the values depend on it.
_ROPE_FROM_MAX_MODEL_LEN = ("MiniMaxM2ForCausalLM", "Plamo3ForCausalLM")
# attention_config fields that change what attention computes (defaults leave them out).
_ATTENTION = (
    "use_non_causal",
    "use_prefill_query_quantization",
    "disable_flashinfer_q_quantization",
    "indexer_kv_dtype",
    "indexer_sparse_logits",
)
# Set on hf_config by a model's constructor (in the worker's process); keyed from the
# settings that decide it instead, so every executor backend keys alike.
SET_BY_MODEL = ("attn_temperature_tuning",)


def rope_parameters(hf_config: Any) -> list[dict]:
    """Every RoPE parameter set of the model (one per layer type in newer configs)."""
    found = []
    for config in (hf_config, getattr(hf_config, "text_config", None)):
        if config is None:
            continue
        for name in ("rope_parameters", "rope_scaling"):
            value = getattr(config, name, None)
            if isinstance(value, dict):
                if any(isinstance(v, dict) for v in value.values()):
                    found += [v for v in value.values() if isinstance(v, dict)]
                else:
                    found.append(value)
    return found


def _rope_type(params: dict) -> str:
    return str(params.get("rope_type") or params.get("type") or "default")


def kv_settings(vllm_config: Any) -> dict[str, str]:
    """The engine's KV-changing settings, by name; empty for most engines."""
    model_config = vllm_config.model_config
    hf_config = getattr(model_config, "hf_config", None)
    max_model_len = getattr(model_config, "max_model_len", None)
    ropes = rope_parameters(hf_config)
    out: dict[str, str] = {}
    for params in ropes:
        if _rope_type(params) in ("longrope", "su") and isinstance(max_model_len, int):
            # phi3_long_rope_scaled_rope.py: long factors iff max_model_len > original length
            original = params.get("original_max_position_embeddings") or getattr(
                getattr(hf_config, "text_config", None) or hf_config, "original_max_position_embeddings", None
            )
            if original is not None:
                out["longrope_factors"] = "long" if max_model_len > int(original) else "short"
    architectures = tuple(getattr(hf_config, "architectures", None) or ())
    if any(a in _ROPE_FROM_MAX_MODEL_LEN for a in architectures) and any(
        _rope_type(p) != "default" for p in ropes
    ):
        out["max_model_len"] = str(max_model_len)
    if any(a.startswith("Llama4") for a in architectures):
        out["attn_temperature_tuning"] = str(_llama4_temperature_tuning(model_config, max_model_len))
    quantization_config = getattr(model_config, "quantization_config", None)
    if quantization_config:
        out["quantization_config"] = _text(quantization_config)
    overrides = getattr(model_config, "model_class_overrides", None)
    if overrides:
        out["model_class_overrides"] = _text(overrides)
    skipped = getattr(getattr(vllm_config, "cache_config", None), "kv_cache_dtype_skip_layers", None)
    if skipped:
        out["kv_cache_dtype_skip_layers"] = _text(sorted(skipped))
    attention = getattr(vllm_config, "attention_config", None)
    for name in _ATTENTION:
        value = getattr(attention, name, None)
        if value not in (None, False, "auto"):
            out[f"attention.{name}"] = _text(value)
    return out


def _llama4_temperature_tuning(model_config: Any, max_model_len: Any) -> bool:
    """llama4.py: the generation config's ``attn_temperature_tuning`` (overrides applied), by
    default on when max_model_len > 32768."""
    generation: dict = {}
    try:
        generation = dict(model_config.try_get_generation_config() or {})
    except Exception:  # noqa: BLE001 - a missing generation config means vLLM's default
        pass
    generation.update(getattr(model_config, "override_generation_config", None) or {})
    default = isinstance(max_model_len, int) and max_model_len > 32768
    return bool(generation.get("attn_temperature_tuning", default))


def _text(value: Any) -> str:
    if hasattr(value, "model_dump"):
        value = value.model_dump()
    elif hasattr(value, "__dict__") and not isinstance(value, (dict, list, tuple, str)):
        value = vars(value)
    if isinstance(value, dict):
        return ",".join(f"{k}={_text(v)}" for k, v in sorted(value.items(), key=lambda kv: str(kv[0])))
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_text(v) for v in value) + "]"
    return str(value)
