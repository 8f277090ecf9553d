"""A segment chunk's payload in a tier: where its KV was computed, and its K and V token by token.

A prefix chunk's payload is whole vLLM blocks (the backend's own layout, copied block by block).
A segment lands at any offset of a later prompt's blocks, and the blender reads and writes K and
V per token, so a segment chunk is stored token-major, this rank's KV heads only:

    prefix  16 bytes: the position of the chunk's first token when computed, its token count
            (two little-endian unsigned 64-bit integers)
    KV      per layer: K then V, each [tokens, kv_heads, head_size] in the model's dtype

Tiers treat it as any payload (checksummed, tagged with a store key, refused when damaged), so
the position is covered by the same checks as the KV. Reading refuses a payload whose size,
token count or position does not fit what the reader expects: a record planted in a shared
store can name any position, and moving K by a delta past the model's positions would read
outside its rotary tables. Pure logic.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

PREFIX = struct.Struct("<QQ")
PREFIX_BYTES = PREFIX.size


class SegmentRecordInvalid(ValueError):
    """A payload that is not the segment chunk asked for (a tier's ``ChunkCorrupt`` kind)."""


@dataclass(frozen=True, slots=True)
class SegmentShape:
    """One rank's KV per token: ``layers`` x (K, V) x ``kv_heads`` x ``head_size`` elements."""

    layers: int
    kv_heads: int
    head_size: int
    element_bytes: int

    @property
    def token_bytes(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_size * self.element_bytes

    @property
    def layer_half_elements(self) -> int:
        """Elements of one token's K (or V) in one layer."""
        return self.kv_heads * self.head_size

    def payload_bytes(self, tokens: int) -> int:
        return PREFIX_BYTES + tokens * self.token_bytes


@dataclass(frozen=True, slots=True)
class SegmentRecord:
    position: int  # rotary position of the first token when its KV was computed
    tokens: int
    kv: memoryview  # the KV bytes, layer by layer, K then V, token-major


def prefix(position: int, tokens: int) -> bytes:
    """The 16 bytes before a segment chunk's KV."""
    if position < 0 or tokens <= 0:
        raise ValueError(f"a segment chunk at position {position} with {tokens} tokens")
    return PREFIX.pack(position, tokens)


def read(payload: memoryview | bytes, shape: SegmentShape, tokens: int, max_positions: int) -> SegmentRecord:
    """The record in ``payload`` of a chunk of ``tokens`` tokens, whose positions must all lie
    below ``max_positions`` (the model's), or ``SegmentRecordInvalid`` saying why not."""
    if tokens <= 0:
        raise ValueError(f"a segment chunk of {tokens} tokens")
    view = memoryview(payload).cast("B")
    if view.nbytes < PREFIX_BYTES:
        raise SegmentRecordInvalid(f"a segment payload of {view.nbytes} bytes, shorter than its prefix")
    position, count = PREFIX.unpack(view[:PREFIX_BYTES])
    if count != tokens:
        raise SegmentRecordInvalid(f"a segment chunk of {count} tokens where {tokens} were asked for")
    want = shape.payload_bytes(tokens)
    if view.nbytes != want:
        raise SegmentRecordInvalid(
            f"a segment payload of {view.nbytes} bytes where {tokens} tokens take {want}"
        )
    if position + tokens > max_positions:
        raise SegmentRecordInvalid(
            f"a segment chunk computed at positions {position}-{position + tokens - 1}, past the "
            f"model's {max_positions}"
        )
    return SegmentRecord(position, tokens, view[PREFIX_BYTES:])
