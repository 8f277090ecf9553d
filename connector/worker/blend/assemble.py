"""A blended prompt's input from the segment chunks its tiers returned.

Each loaded chunk is K and V of its tokens as computed with its first token at the position its
record names; in this prompt it starts at ``start``. K is moved by ``start - position`` with the
model's own rotary embedding (``RopeShift``); V carries no position. The chunks' tokens are the
reused ones; every other token (separators, the question, segments not stored or too short) has
no reused KV and is computed by the blend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .blender import BlendInput
from .rope_shift import RopeShift


@dataclass(frozen=True)
class LoadedChunk:
    start: int  # the chunk's first token, in this prompt
    position: int  # where its KV was computed (its record's)
    keys: Sequence[torch.Tensor]  # per layer [tokens, kv_heads, head_size], this rank's heads
    values: Sequence[torch.Tensor]

    @property
    def num_tokens(self) -> int:
        return self.keys[0].shape[0]


def blend_input(
    token_ids: torch.Tensor, chunks: Sequence[LoadedChunk], shift: RopeShift, dtype: torch.dtype
) -> BlendInput:
    """The ``BlendInput`` of prompt ``token_ids`` (positions 0 onward) reusing ``chunks``, which
    must lie inside the prompt, apart, with the same layers, heads and head size."""
    if not chunks:
        raise ValueError("nothing reused: compute the prompt instead")
    count = token_ids.shape[0]
    layers, (_, heads, size) = len(chunks[0].keys), chunks[0].keys[0].shape
    keys = [torch.zeros(count, heads, size, dtype=dtype) for _ in range(layers)]
    values = [torch.zeros(count, heads, size, dtype=dtype) for _ in range(layers)]
    reused = torch.zeros(count, dtype=torch.bool)
    for chunk in chunks:
        end = chunk.start + chunk.num_tokens
        if chunk.start < 0 or end > count:
            raise ValueError(f"a chunk at {chunk.start}-{end} outside a prompt of {count} tokens")
        if bool(reused[chunk.start : end].any()):
            raise ValueError(f"chunks overlap at {chunk.start}-{end}")
        if len(chunk.keys) != layers or len(chunk.values) != layers:
            raise ValueError("chunks of different layer counts")
        delta = chunk.start - chunk.position
        for layer in range(layers):
            k, v = chunk.keys[layer], chunk.values[layer]
            if k.shape != (chunk.num_tokens, heads, size) or v.shape != k.shape:
                raise ValueError("chunks of different KV heads or head size")
            keys[layer][chunk.start : end] = shift.move(k.to(dtype), delta)
            values[layer][chunk.start : end] = v
        reused[chunk.start : end] = True
    return BlendInput(token_ids, torch.arange(count), reused, keys, values)
