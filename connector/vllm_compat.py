"""Everything KVLens reads from vLLM's config objects, in one place (vLLM 0.32)."""

from __future__ import annotations

import hashlib
import json
import os
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


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".h5", ".msgpack")


def weights_fingerprint(model_dir: str | None, config_text: str, extra: str = "") -> str:
    """A short hash of what identifies the weights: each weight file's name, size and
    modification time (no file is read), the model config and any overrides.

    The model path alone is not enough: a persistent disk tier would serve KV of the old
    weights after the checkpoint at that path is replaced.
    """
    h = hashlib.blake2b(digest_size=8, person=b"kvlens-weights")
    h.update(config_text.encode())
    h.update(extra.encode())
    if model_dir and os.path.isdir(model_dir):
        for root, dirs, files in os.walk(model_dir):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(files):
                if name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json"):
                    path = os.path.join(root, name)
                    st = os.stat(path)
                    h.update(f"{os.path.relpath(path, model_dir)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()


def _model_identity(model_config: Any) -> str:
    model = str(model_config.model)
    directory = (
        model if os.path.isdir(model) else _cached_snapshot(model, getattr(model_config, "revision", None))
    )
    hf_config = getattr(model_config, "hf_config", None)
    try:
        config_text = hf_config.to_json_string() if hf_config is not None else ""
    except Exception:  # a config that cannot serialise itself still has a repr
        config_text = repr(hf_config)
    overrides = getattr(model_config, "hf_overrides", None)
    extra = json.dumps(
        {"revision": getattr(model_config, "revision", None), "overrides": repr(overrides)}, sort_keys=True
    )
    return f"{model}@{weights_fingerprint(directory, config_text, extra)}"


def _cached_snapshot(repo_id: str, revision: str | None) -> str | None:
    """The local snapshot directory vLLM loaded a hub model from (no network)."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, revision=revision, local_files_only=True)
    except Exception:
        return None


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
        model=_model_identity(vllm_config.model_config),
        dtype=str(spec.dtype),
        block_size=spec.block_size,
        num_layers=len(groups[0].layer_names),
        block_bytes=spec.page_size_bytes,
        kv_layout=signature,
        world_size=parallel.tensor_parallel_size * parallel.pipeline_parallel_size,
        kv_role=str(vllm_config.kv_transfer_config.kv_role),
        engine_id=str(getattr(parallel, "data_parallel_rank", 0) or 0),
        kv_events=bool(
            getattr(getattr(vllm_config, "kv_events_config", None), "enable_kv_cache_events", False)
        ),
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


def kv_cache_events(events: list[Any]) -> list[Any]:
    """KVLens's ``BlocksStored`` / ``BlocksRemoved`` as vLLM's ``BlockStored`` / ``BlockRemoved``."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from .engine.block_events import BlocksStored

    out: list[Any] = []
    for e in events:
        hashes = [maybe_convert_block_hash(h) for h in e.block_hashes]
        if isinstance(e, BlocksStored):
            parent = (
                maybe_convert_block_hash(e.parent_block_hash) if e.parent_block_hash is not None else None
            )
            out.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=parent,
                    token_ids=list(e.token_ids),
                    block_size=e.block_size,
                    lora_id=None,
                    medium=e.medium,
                    lora_name=e.lora_name,
                )
            )
        else:
            out.append(BlockRemoved(block_hashes=hashes, medium=e.medium))
    return out
