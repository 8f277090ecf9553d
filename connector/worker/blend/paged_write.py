"""Writes K and V the blender computed into vLLM's paged KV cache, through the attention
backend's own cache write.

Each backend lays its cache out its own way (vLLM-CPU packs K per block in an ISA-dependent
layout; FlashAttention and FlashInfer differ again), and each exposes the write its forward pass
uses: ``impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)`` on the layer's
``Attention`` module, with the cache bound to it. The blender writes a blended request's KV with
that same call, so the bytes are what vLLM's own prefill would have written, in whatever layout,
dtype and scale the backend keeps, and never reads them back: the KV it stores for later comes
from its own output, token-major.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .vllm_llama import NotBlendable


def attention_modules(model: Any) -> list[Any]:
    """The ``Attention`` module of each decoder layer of a model ``VllmLlama`` backs."""
    modules = []
    for number, layer in enumerate(model.model.layers):
        attn = getattr(getattr(layer, "self_attn", None), "attn", None)
        impl = getattr(attn, "impl", None)
        if impl is None or not hasattr(impl, "do_kv_cache_update"):
            raise NotBlendable(f"layer {number}: its attention backend has no do_kv_cache_update")
        modules.append(attn)
    return modules


def slot_mapping(block_ids: Sequence[int], block_size: int, first: int, count: int) -> torch.Tensor:
    """Cache slots of a request's tokens ``first``..``first + count - 1`` in its blocks."""
    index = torch.arange(first, first + count)
    blocks = torch.as_tensor(list(block_ids), dtype=torch.long)
    if count and int(index[-1]) // block_size >= blocks.numel():
        raise ValueError(f"token {int(index[-1])} lies past the request's {blocks.numel()} blocks")
    return blocks[index // block_size] * block_size + index % block_size


def write_layer(attn: Any, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    """K and V [n, Hkv, D] (this rank's heads) into ``slots`` [n] of the layer's bound cache."""
    cache = attn.kv_cache
    if not isinstance(cache, torch.Tensor) or cache.numel() == 0:
        raise NotBlendable(f"{getattr(attn, 'layer_name', 'a layer')}: no KV cache bound yet")
    dtype = getattr(attn, "dtype", None) or keys.dtype
    attn.impl.do_kv_cache_update(
        attn,
        keys.to(dtype).contiguous(),
        values.to(dtype).contiguous(),
        cache,
        slots.to(device=cache.device, dtype=torch.long),
    )
