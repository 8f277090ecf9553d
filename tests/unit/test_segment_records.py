"""Segment chunk payloads: the position and token count before token-major K and V, and a read
that refuses any payload not of the chunk asked for (a planted record can say anything)."""

from __future__ import annotations

import pytest
import torch

from connector.engine.segment_records import PREFIX_BYTES, SegmentRecordInvalid, SegmentShape, prefix, read
from connector.worker.blend.segment_kv import from_payload, shape_of, to_payload

SHAPE = SegmentShape(layers=3, kv_heads=2, head_size=4, element_bytes=2)
MAX_POSITIONS = 4096


def kv(tokens: int, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(tokens, 2, 4, generator=g).to(dtype) for _ in range(3)]
    values = [torch.randn(tokens, 2, 4, generator=g).to(dtype) for _ in range(3)]
    return keys, values


def test_a_chunk_comes_back_bit_for_bit_with_its_position():
    keys, values = kv(10)
    payload = to_payload(700, keys, values, 2, 8)  # tokens 2-7 of a segment computed at 698
    assert len(payload) == SHAPE.payload_bytes(6) == PREFIX_BYTES + 6 * SHAPE.token_bytes
    position, got_k, got_v = from_payload(payload, shape_of(keys), torch.bfloat16, 6, MAX_POSITIONS)
    assert position == 700
    for layer in range(3):
        assert torch.equal(got_k[layer], keys[layer][2:8]) and torch.equal(got_v[layer], values[layer][2:8])


def test_the_layout_is_layer_by_layer_k_then_v_token_major():
    keys, values = kv(2, torch.float32)
    payload = memoryview(to_payload(0, keys, values, 0, 2))[PREFIX_BYTES:]
    floats = torch.frombuffer(bytearray(payload), dtype=torch.float32)
    per_half = 2 * 2 * 4
    assert torch.equal(floats[:per_half], keys[0].flatten())
    assert torch.equal(floats[per_half : 2 * per_half], values[0].flatten())
    assert torch.equal(floats[2 * per_half : 3 * per_half], keys[1].flatten())


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda p: p[:-1], "bytes where"),
        (lambda p: p + b"\0", "bytes where"),
        (lambda p: p[:10], "shorter than its prefix"),
        (lambda p: prefix(5, 7) + p[PREFIX_BYTES:], "of 7 tokens where 6"),
        (lambda p: prefix(MAX_POSITIONS - 5, 6) + p[PREFIX_BYTES:], "past the model's"),
        (lambda p: prefix(2**63, 6) + p[PREFIX_BYTES:], "past the model's"),
    ],
)
def test_a_payload_that_is_not_the_chunk_asked_for_is_refused(damage, why):
    keys, values = kv(6)
    payload = to_payload(100, keys, values, 0, 6)
    with pytest.raises(SegmentRecordInvalid, match=why):
        read(damage(payload), SHAPE, 6, MAX_POSITIONS)
    with pytest.raises(SegmentRecordInvalid):
        from_payload(damage(payload), SHAPE, torch.bfloat16, 6, MAX_POSITIONS)


def test_a_chunk_ending_at_the_last_position_is_read():
    keys, values = kv(6)
    payload = to_payload(MAX_POSITIONS - 6, keys, values, 0, 6)
    assert read(payload, SHAPE, 6, MAX_POSITIONS).position == MAX_POSITIONS - 6


def test_what_no_caller_may_ask_is_a_value_error():
    keys, values = kv(4)
    with pytest.raises(ValueError):
        prefix(-1, 4)
    with pytest.raises(ValueError):
        to_payload(0, keys, values, 2, 2)  # no token
    with pytest.raises(ValueError):
        to_payload(0, keys, values[:2], 0, 4)  # V of fewer layers
    with pytest.raises(ValueError):
        from_payload(to_payload(0, keys, values, 0, 4), SHAPE, torch.float32, 4, MAX_POSITIONS)
    with pytest.raises(ValueError):
        read(to_payload(0, keys, values, 0, 4), SHAPE, 0, MAX_POSITIONS)
