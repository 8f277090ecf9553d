"""What a blend hands on (small random Llama, fp32): its K and V written into the request's
blocks through the layer's own cache write, only the tokens vLLM does not hold or compute, and
the payloads of the chunks it computed, each at its position in the prompt."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from connector.engine.keys import Namespace
from connector.engine.segment_keys import segment_chunks
from connector.engine.segments import Segment
from connector.worker.blend.assemble import LoadedChunk, blend_input
from connector.worker.blend.blend_output import chunk_payloads, write_blocks
from connector.worker.blend.blender import blend
from connector.worker.blend.hf_llama import HFLlama, prefill_kv
from connector.worker.blend.segment_kv import from_payload, shape_of
from connector.worker.blend.selection import CheckLayer

DOC_A = torch.arange(12) % 150 + 20
DOC_B = torch.arange(10) % 150 + 60
SEP = torch.tensor([7, 7])
IDS = torch.cat([torch.tensor([3, 4]), DOC_A, SEP, DOC_B, SEP, torch.tensor([11, 12, 13])])
A_AT, B_AT = 2, 2 + 12 + 2
NS = Namespace("model", "float32", "bs4:L4")


class RecordingAttention:
    """An ``Attention`` module's surface as ``paged_write`` uses it; the write records its call."""

    def __init__(self) -> None:
        self.kv_cache = torch.zeros(1)
        self.dtype = torch.float32
        self.calls = []
        self.impl = SimpleNamespace(do_kv_cache_update=self._update)

    def _update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        self.calls.append((key.clone(), value.clone(), slot_mapping.tolist()))


@pytest.fixture(scope="module")
def blended(llama):
    """A prompt reusing document A (stored alone at position 0) and computing B (not stored)."""
    model = HFLlama(llama)
    a_k, a_v, _ = prefill_kv(llama, DOC_A)
    prompt = blend_input(IDS, [LoadedChunk(A_AT, 0, a_k, a_v)], model.rope_shift(), torch.float32)
    return model, blend(model, prompt, [CheckLayer(1, ratio=0.2)])


def test_the_blend_writes_the_tokens_vllm_neither_holds_nor_computes_into_the_requests_slots(blended):
    _, result = blended
    attention = [RecordingAttention() for _ in result.keys]
    block_ids, first, last = [7, 2, 9, 4, 6, 8, 1, 5], 8, len(IDS) - 1  # vLLM holds 8, computes the last
    assert write_blocks(attention, result, block_ids, 4, first, last) == last - first
    want_slots = [block_ids[i // 4] * 4 + i % 4 for i in range(first, last)]
    for layer, attn in enumerate(attention):
        ((key, value, slots),) = attn.calls
        assert slots == want_slots
        assert torch.equal(key, result.keys[layer][first:last])
        assert torch.equal(value, result.values[layer][first:last])
    assert write_blocks(attention, result, block_ids, 4, last, last) == 0
    with pytest.raises(ValueError):
        write_blocks(attention, result, block_ids[:2], 4, first, last)  # blocks too few
    with pytest.raises(ValueError):
        write_blocks(attention[:-1], result, block_ids, 4, first, last)


def test_a_computed_chunk_is_stored_at_its_position_and_reused_elsewhere(blended, llama):
    model, result = blended
    (b_chunk,) = segment_chunks(NS, IDS.tolist(), Segment(1, B_AT, B_AT + len(DOC_B), True), 256)
    ((chunk, payload),) = chunk_payloads(result, [b_chunk])
    position, keys, values = from_payload(payload, shape_of(result.keys), torch.float32, len(DOC_B), 512)
    assert chunk is b_chunk and position == B_AT
    for layer in range(len(keys)):
        assert torch.equal(keys[layer], result.keys[layer][B_AT : B_AT + len(DOC_B)])
    # B first in another prompt: its K moved back to position 1; layer 0 is B's own K there
    moved = blend_input(
        torch.cat([torch.tensor([5]), DOC_B, SEP]),
        [LoadedChunk(1, position, keys, values)],
        model.rope_shift(),
        torch.float32,
    )
    own_k, _, _ = prefill_kv(llama, DOC_B, start=1)
    torch.testing.assert_close(moved.keys[0][1:11], own_k[0], rtol=1e-4, atol=1e-4)


def test_a_chunk_the_blend_reused_is_not_stored_from_it(blended):
    _, result = blended
    (a_chunk,) = segment_chunks(NS, IDS.tolist(), Segment(0, A_AT, A_AT + len(DOC_A), True), 256)
    # the premise: at ratio 0.2 the check leaves some of A's tokens reused
    assert not set(range(A_AT, A_AT + len(DOC_A))) <= set(result.report.recomputed_index)
    with pytest.raises(ValueError, match="not computed"):
        chunk_payloads(result, [a_chunk])
