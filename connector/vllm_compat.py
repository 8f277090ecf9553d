"""Everything KVLens reads from vLLM's config objects, in one place (vLLM 0.32)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from .config.loading import ConfigError
from .engine.facts import EngineFacts, ModelIdentity
from .identity import checkpoint as checkpoint_identity
from .identity.kv_settings import SET_BY_MODEL, kv_settings
from .identity.weights_digests import DigestCache, default_cache_path

logger = logging.getLogger("vllm.kvlens")


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


def model_identity(vllm_config: Any, named: str | None = None) -> ModelIdentity:
    """What about the model changes its KV's values, from content and settings, not places.

    ``named``: the operator's name for the weights (``extra_config.model_identity``), used
    instead of reading the checkpoint.
    """
    model_config = vllm_config.model_config
    cache_config = getattr(vllm_config, "cache_config", None)
    load_config = getattr(vllm_config, "load_config", None)
    settings = kv_settings(vllm_config)
    if settings:
        logger.info("KVLens model identity: engine settings that change the KV: %s", settings)
    if str(getattr(load_config, "load_format", "auto")) == "dummy":
        weights = "dummy"  # vLLM's seeded random weights, whatever the checkpoint holds
    else:
        weights = f"named:{named}" if named else _weights_identity(model_config, load_config)
    return ModelIdentity(
        weights=weights,
        config=_config_digest(getattr(model_config, "hf_config", None), settings),
        dtype=str(getattr(model_config, "dtype", "")).removeprefix("torch."),
        quantization=str(getattr(model_config, "quantization", None) or "none"),
        kv_cache_dtype=str(getattr(cache_config, "cache_dtype", None) or "auto"),
    )


def _weights_identity(model_config: Any, load_config: Any = None) -> str:
    model = str(model_config.model)
    download_dir = getattr(load_config, "download_dir", None)
    where = (
        model
        if os.path.exists(model)
        else _cached_snapshot(model, getattr(model_config, "revision", None), download_dir)
    )
    ignore = getattr(load_config, "ignore_patterns", None)
    ignore = (
        checkpoint_identity.IGNORE
        if ignore is None
        else (ignore,)
        if isinstance(ignore, str)
        else tuple(ignore)
    )
    started = time.perf_counter()
    try:
        found = (
            checkpoint_identity.fingerprint(
                where,
                DigestCache(default_cache_path()),
                str(getattr(load_config, "load_format", None) or "auto"),
                ignore,
            )
            if where
            else None
        )
    except OSError as e:
        logger.warning("KVLens: cannot read the checkpoint at %s (%s)", where, e)
        found = None
    if found is None:
        logger.warning(
            "KVLens: no weight files found for %s: its KV is keyed by the model's name, so instances "
            "share only when they name it alike; set extra_config.model_identity to name the weights",
            model,
        )
        return f"path:{model}"
    logger.info(
        "KVLens model identity ckpt:%s from %d files (%.1f GB, %d digests remembered): hashed "
        "%.1f GB in %.0f ms",
        found.digest,
        found.files,
        found.total_bytes / 1e9,
        found.cached_files,
        found.read_bytes / 1e9,
        (time.perf_counter() - started) * 1000,
    )
    return f"ckpt:{found.digest}"


# Configuration entries that say where or by which library version a model was loaded, not
# what it computes, and those a model's constructor sets (kv_settings keys what decides them).
_CONFIG_NOT_IDENTITY = (
    "_name_or_path",
    "name_or_path",
    "transformers_version",
    "_commit_hash",
    *SET_BY_MODEL,
)


def _config_digest(hf_config: Any, settings: dict[str, str] | None = None) -> str:
    """Digest of the HF config as vLLM computes with it, and of the engine settings that
    change the KV (absent when there are none, so most configs digest as before)."""
    if hf_config is None:
        data: Any = None
    else:
        try:
            data = _without_places(hf_config.to_dict())
        except Exception:  # noqa: BLE001 - a config that cannot serialise itself still has a repr
            data = repr(hf_config)
    if data is None and not settings:
        return "none"
    if settings:
        data = {"hf_config": data, "kv_settings": settings}
    text = data if isinstance(data, str) else json.dumps(data, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def _without_places(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_places(v) for k, v in value.items() if k not in _CONFIG_NOT_IDENTITY}
    if isinstance(value, list):
        return [_without_places(v) for v in value]
    return value


def _cached_snapshot(repo_id: str, revision: str | None, download_dir: str | None = None) -> str | None:
    """The local snapshot directory vLLM loaded a hub model from (no network): under
    ``--download-dir`` when vLLM was given one, else the hub's cache."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, revision=revision, cache_dir=download_dir, local_files_only=True)
    except Exception:
        return None


def engine_facts(
    vllm_config: Any, kv_cache_config: Any, identity: ModelIdentity | None = None
) -> EngineFacts:
    """What KVLens needs to know about the engine. ``identity``: the model's (the scheduler
    half computes it; the workers do not key anything and pass None)."""
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
        model=identity.key() if identity is not None else "",
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
        identity=identity,
        failed_blocks_stay_cached=getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "fail")
        == "recompute",
    )


def attention_in_full_graph(forward_context: Any) -> bool:
    """Whether this step's attention runs inside a full CUDA graph: vLLM then calls neither
    ``wait_for_layer_load`` nor ``save_kv_layer`` (they are skipped on replay), so every load
    must be in before the graph starts. vLLM 0.32: ``cudagraph_runtime_mode`` is
    ``CUDAGraphMode.FULL`` (uniform decode batches by default, where a request whose whole
    prompt was found computes one token)."""
    mode = getattr(forward_context, "cudagraph_runtime_mode", None)
    return getattr(mode, "name", None) == "FULL"


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
    """KVLens's ``BlocksStored`` / ``BlocksRemoved`` / ``BlocksCleared`` as vLLM's ``BlockStored`` /
    ``BlockRemoved`` / ``AllBlocksCleared``."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from .engine.block_events import BlocksCleared, BlocksStored

    out: list[Any] = []
    for e in events:
        if isinstance(e, BlocksCleared):
            out.append(AllBlocksCleared())
            continue
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


def block_ids_of(blocks: Any) -> list[int]:
    """The block ids of vLLM's ``KVCacheBlocks`` for the one KV cache group KVLens supports."""
    ids = blocks.get_block_ids()
    return list(ids[0]) if ids else []


def engine_wakeup() -> Callable[[], None] | None:
    """A function that wakes vLLM's engine core loop when it idles, so that it steps and the
    scheduler half applies queued admin commands; None outside a multiprocess engine core.

    The connector is built inside ``EngineCoreProc.__init__``, whose input queue already exists:
    an idle engine blocks on that queue, and vLLM wakes it with a ``WAKEUP`` request (as its own
    shutdown handler does). The engine then steps while ``has_pending_push_work`` says so.
    """
    import queue

    from vllm.v1.engine import EngineCoreRequestType

    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        inputs = getattr(owner, "input_queue", None)
        if isinstance(inputs, queue.Queue) and type(owner).__name__.startswith("EngineCore"):
            return lambda: inputs.put_nowait((EngineCoreRequestType.WAKEUP, None))
        frame = frame.f_back
    return None


def kv_block_slots(vllm_config: Any, kv_cache: Any) -> Any:
    """The token slot (0 .. block_size-1) of every element of one block of ``kv_cache`` (one
    layer's KV tensor, ``[num_blocks, num_kv_heads, block_size, 2*head_size]``), as a tensor shaped
    like ``kv_cache[0]``; None (logged) where it cannot be told.

    On CPU the attention kernel packs K and V inside a block by ISA (REFERENCE.md 1.6), so the
    map is probed: the kernel, with the ISA and cache dtype the backend picks, writes one token
    slot at a time into a zeroed one-block scratch tensor, and the elements that turn non-zero are
    that slot's; every element must be exactly one slot's. On other backends a token's K and V
    sit at its index in logical dim 2 (``KVCacheLayout`` only permutes strides).
    """
    import torch

    if kv_cache.dim() != 4:
        logger.warning("KVLens: KV tensor of shape %s is not [blocks, heads, slots, 2*head]", kv_cache.shape)
        return None
    _, heads, block_size, width = kv_cache.shape
    if kv_cache.device.type != "cpu":
        return torch.arange(block_size).view(1, block_size, 1).expand(heads, block_size, width).clone()
    try:
        return _probe_cpu_block_slots(vllm_config, kv_cache)
    except Exception as e:  # a private kernel entry point: an unknown map is safe, a crash is not
        logger.warning("KVLens: probing the CPU attention kernel's packing failed: %s", e)
        return None


def _probe_cpu_block_slots(vllm_config: Any, kv_cache: Any) -> Any:
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    _, heads, block_size, width = kv_cache.shape
    head_size = width // 2
    model_dtype = vllm_config.model_config.dtype
    cache_dtype = vllm_config.cache_config.cache_dtype
    isa = _get_attn_isa(model_dtype, block_size, head_size, cache_dtype)
    if not kv_cache[0].is_contiguous():
        logger.warning("KVLens: the CPU KV tensor's blocks are not contiguous; no map of token slots")
        return None
    scratch = torch.zeros((1, heads, block_size, width), dtype=kv_cache.dtype)
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[scratch.element_size()]
    key_cache, value_cache = scratch.view(1, heads, 2 * block_size, head_size).chunk(2, dim=2)
    ones = torch.ones((1, heads, head_size), dtype=model_dtype)
    owner = torch.full((heads, block_size, width), -1, dtype=torch.int64)
    for slot in range(block_size):
        scratch.zero_()
        ops.cpu_attn_reshape_and_cache(
            ones, ones, key_cache, value_cache, torch.tensor([slot]), isa, 1.0, 1.0, cache_dtype
        )
        touched = scratch[0].view(as_int) != 0
        if bool((owner[touched] >= 0).any()):
            logger.warning("KVLens: ISA %s writes token slot %d over another slot's elements", isa, slot)
            return None
        owner[touched] = slot
    if bool((owner < 0).any()):
        logger.warning("KVLens: ISA %s leaves %d elements of a block to no slot", isa, int((owner < 0).sum()))
        return None
    logger.info("KVLens: token slots of a KV block probed from the CPU kernel (ISA %s)", isa)
    return owner


def blend_separators(vllm_config: Any, text: str) -> list[tuple[int, ...]]:
    """The separator's token ids with the model's tokenizer, without special tokens (what a
    client joining token ids puts between a prompt's parts; ``engine/segments.py``)."""
    from transformers import AutoTokenizer

    from .engine.segments import separator_ids

    model = vllm_config.model_config
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            model.tokenizer, revision=model.tokenizer_revision, trust_remote_code=model.trust_remote_code
        )
        return [separator_ids(lambda s: tokenizer.encode(s, add_special_tokens=False), text)]
    except (OSError, ValueError) as e:
        raise ConfigError(f"enable_blending: the separator {text!r} cannot be tokenized: {e}") from e
