"""What a blend hands on: its K and V written into the request's paged blocks, and the payloads of
the segment chunks it computed, for the tiers.

vLLM computes the prompt's last token itself (the logits come from its forward pass), and the
tokens it already holds (its own prefix cache hits) sit in blocks other requests share, never
written: the blend writes tokens ``first`` to ``last - 1`` only. A chunk stored for next time is a
chunk the blend computed (its segment was not found in the tiers), so every one of its tokens was
recomputed through every layer over this prompt's KV; its position is where it sits here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...engine.segment_keys import SegmentChunk
from .blender import BlendResult
from .paged_write import slot_mapping, write_layer
from .segment_kv import to_payload


def write_blocks(
    attention: Sequence[Any],
    result: BlendResult,
    block_ids: Sequence[int],
    block_size: int,
    first: int,
    last: int,
) -> int:
    """Writes every layer's K and V of tokens ``first`` to ``last - 1`` into the request's blocks
    (``attention``: each layer's ``Attention`` module); the number of tokens written."""
    if len(attention) != len(result.keys):
        raise ValueError(f"{len(attention)} attention layers for a blend of {len(result.keys)}")
    if not 0 <= first <= last <= result.report.tokens:
        raise ValueError(f"tokens {first}-{last} of a blend of {result.report.tokens}")
    if last == first:
        return 0
    slots = slot_mapping(block_ids, block_size, first, last - first)
    for attn, keys, values in zip(attention, result.keys, result.values, strict=True):
        write_layer(attn, keys[first:last], values[first:last], slots)
    return last - first


def chunk_payloads(result: BlendResult, computed: Sequence[SegmentChunk]) -> list[tuple[SegmentChunk, bytes]]:
    """The tier payload of each chunk in ``computed`` (the blend computed every token of it)."""
    recomputed = set(result.report.recomputed_index)
    out = []
    for chunk in computed:
        if chunk.end > result.report.tokens or not recomputed.issuperset(range(chunk.start, chunk.end)):
            raise ValueError(f"chunk {chunk.start}-{chunk.end} was not computed by this blend")
        out.append((chunk, to_payload(chunk.start, result.keys, result.values, chunk.start, chunk.end)))
    return out
