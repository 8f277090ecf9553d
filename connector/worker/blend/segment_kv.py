"""A segment chunk's K and V to and from its tier payload (``engine/segment_records.py``).

The blender holds K and V per layer as [tokens, kv_heads, head_size] tensors of this rank's heads;
a chunk's payload is its prefix, then per layer K then V of the chunk's tokens, contiguous. Reading
gives tensors over the payload's own bytes (no copy); the blender copies what it moves.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from ...engine import segment_records
from ...engine.segment_records import SegmentShape


def shape_of(keys: Sequence[torch.Tensor]) -> SegmentShape:
    """The per-token shape of ``keys`` (per layer [tokens, kv_heads, head_size])."""
    _, heads, size = keys[0].shape
    return SegmentShape(len(keys), heads, size, keys[0].element_size())


def to_payload(
    position: int, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], start: int, end: int
) -> bytes:
    """The payload of the chunk made of tokens ``start:end`` of ``keys`` and ``values``, computed
    with its first token at rotary ``position``."""
    if len(keys) != len(values) or not keys:
        raise ValueError("K and V of the same layers, at least one")
    parts = [segment_records.prefix(position, end - start)]
    for k, v in zip(keys, values, strict=True):
        for half in (k, v):
            if half.shape[1:] != keys[0].shape[1:] or half.dtype != keys[0].dtype:
                raise ValueError("every layer's K and V must share heads, head size and dtype")
            parts.append(half[start:end].contiguous().view(torch.uint8).numpy().tobytes())
    return b"".join(parts)


def from_payload(
    payload: memoryview | bytes,
    shape: SegmentShape,
    dtype: torch.dtype,
    tokens: int,
    max_positions: int,
) -> tuple[int, list[torch.Tensor], list[torch.Tensor]]:
    """The position, and per layer K and V ([tokens, kv_heads, head_size], over the payload's
    bytes: read them, never write them), of a chunk of ``tokens`` tokens;
    ``SegmentRecordInvalid`` if the payload is not one."""
    if torch.empty((), dtype=dtype).element_size() != shape.element_bytes:
        raise ValueError(f"{dtype} is not {shape.element_bytes} bytes an element")
    record = segment_records.read(payload, shape, tokens, max_positions)
    with warnings.catch_warnings():  # a tier's payload may be read-only; nothing writes these
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(record.kv, dtype=torch.uint8)
    half = tokens * shape.layer_half_elements * shape.element_bytes
    keys, values = [], []
    for layer in range(shape.layers):
        at = 2 * layer * half
        for out, begin in ((keys, at), (values, at + half)):
            out.append(flat[begin : begin + half].view(dtype).view(tokens, shape.kv_heads, shape.head_size))
    return record.position, keys, values
