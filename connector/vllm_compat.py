"""Everything KVLens reads from vLLM's config objects, in one place (vLLM 0.32)."""

from __future__ import annotations

from typing import Any

from .config import ConfigError
from .engine.facts import EngineFacts


def _attention_packing(vllm_config: Any, spec: Any) -> str:
    """Which kernel packing the KV blocks use; KV from another packing is incompatible."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        try:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            return "cpu-" + _get_attn_isa(
                spec.dtype, spec.block_size, spec.head_size, vllm_config.cache_config.cache_dtype
            )
        except Exception:  # private helper; fall back to what identifies the machine kind
            import platform

            return "cpu-" + platform.machine()
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return f"{current_platform.device_name}-{backend or 'auto'}"


def _check_full_attention(spec: Any) -> None:
    """Only full-attention managers keep every block of a prefix. Sliding-window and chunked
    local managers hand out placeholder blocks; copying those would store garbage. (A
    FullAttentionSpec that carries a window keeps all blocks, so it is fine.)"""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    if type(spec) not in (FullAttentionSpec, MLAAttentionSpec):
        raise ConfigError(
            f"KVLens supports full-attention KV caches only; this model's is {type(spec).__name__}"
        )


def engine_facts(vllm_config: Any, kv_cache_config: Any) -> EngineFacts:
    if kv_cache_config is None:
        raise ConfigError("KVLens needs vLLM's kv_cache_config (vLLM >= 0.11)")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(f"KVLens supports models with one KV cache group; this model has {len(groups)}")
    spec = groups[0].kv_cache_spec
    _check_full_attention(spec)
    parallel = vllm_config.parallel_config
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or "default"
    kernel = _attention_packing(vllm_config, spec)
    signature = (
        f"{type(spec).__name__}:bs{spec.block_size}:h{getattr(spec, 'num_kv_heads', '?')}"
        f":d{getattr(spec, 'head_size', '?')}:{spec.dtype}:page{spec.page_size_bytes}"
        f":L{len(groups[0].layer_names)}:{layout}:{kernel}"
    )
    return EngineFacts(
        model=str(vllm_config.model_config.model),
        dtype=str(spec.dtype),
        block_size=spec.block_size,
        num_layers=len(groups[0].layer_names),
        block_bytes=spec.page_size_bytes,
        kv_layout=signature,
        world_size=parallel.tensor_parallel_size * parallel.pipeline_parallel_size,
        kv_role=str(vllm_config.kv_transfer_config.kv_role),
        engine_id=str(getattr(parallel, "data_parallel_rank", 0) or 0),
    )


def worker_rank() -> int:
    from vllm.distributed.parallel_state import (
        get_pp_group,
        get_tensor_model_parallel_rank,
        get_tp_group,
    )

    try:
        tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tp_group().world_size
        return get_pp_group().rank_in_group * tp_size + tp_rank
    except (AssertionError, AttributeError):  # no distributed groups (single process)
        return 0
