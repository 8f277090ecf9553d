"""A blended prompt's input from stored segment chunks (small random Llama, fp32): documents
computed inside one prompt, stored as tier payloads with their positions there, then reused in
another prompt in another order, behind another prefix. Their K moved to the new positions is the
K a full prefill computes for them alone at those positions; blending with every token
recomputed gives the full prefill of the new prompt."""

from __future__ import annotations

import pytest
import torch

from connector.worker.blend.assemble import LoadedChunk, blend_input
from connector.worker.blend.blender import blend
from connector.worker.blend.hf_llama import HFLlama, prefill_kv
from connector.worker.blend.segment_kv import from_payload, shape_of, to_payload
from connector.worker.blend.selection import CheckLayer

DOC_A = torch.arange(20) % 150 + 20
DOC_B = torch.arange(16) % 150 + 60
SEP = torch.tensor([7, 7])


def stored_chunks(model, prompt_parts, reuse):
    """Prefill of the first prompt (its documents at their positions in it), and each document in
    ``reuse`` as a tier payload cut from that prefill, with its position."""
    ids = torch.cat(prompt_parts)
    keys, values, _ = prefill_kv(model, ids)
    payloads, at = {}, 0
    for part in prompt_parts:
        for name, doc in reuse.items():
            if part is doc:
                payloads[name] = (to_payload(at, keys, values, at, at + len(doc)), len(doc))
        at += len(part)
    return payloads, shape_of(keys)


def test_documents_stored_from_one_prompt_are_moved_into_another(llama):
    model = HFLlama(llama)
    payloads, shape = stored_chunks(
        llama, [torch.tensor([3, 4, 5]), DOC_A, SEP, DOC_B], {"a": DOC_A, "b": DOC_B}
    )
    # the new prompt: another prefix, B before A
    parts = [torch.tensor([9, 8, 7, 6, 5, 4, 3]), DOC_B, SEP, DOC_A, SEP, torch.tensor([11, 12])]
    ids = torch.cat(parts)
    starts = {"b": 7, "a": 7 + len(DOC_B) + 2}
    chunks = []
    for name, start in starts.items():
        payload, tokens = payloads[name]
        position, keys, values = from_payload(payload, shape, torch.float32, tokens, 512)
        chunks.append(LoadedChunk(start, position, keys, values))
    prompt = blend_input(ids, chunks, model.rope_shift(), torch.float32)
    assert prompt.reused.sum() == len(DOC_A) + len(DOC_B)
    assert not prompt.reused[:7].any() and not prompt.reused[-2:].any()
    # A's K and V as computed after the first prompt's 3 tokens, K moved to where A now sits: A's
    # own prefill at its new positions, but for what A attended to before it (V, which has no
    # position, and K's content both carry that): layer 0, which sees only each token itself,
    # is exact
    alone_k, alone_v, _ = prefill_kv(llama, DOC_A, start=starts["a"])
    a = slice(starts["a"], starts["a"] + len(DOC_A))
    torch.testing.assert_close(prompt.keys[0][a], alone_k[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(prompt.values[0][a], alone_v[0], rtol=1e-4, atol=1e-4)
    # every token recomputed: the full prefill of the new prompt
    full_k, full_v, full_logits = prefill_kv(llama, ids)
    result = blend(model, prompt, [CheckLayer(1, ratio=1.0)])
    assert result.report.recomputed == len(ids)
    for got, want in zip(result.keys + result.values, full_k + full_v, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.logits(result.last_hidden), full_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("starts", "why"),
    [((0, 30), "outside a prompt"), ((-1,), "outside a prompt"), ((2, 5), "overlap")],
)
def test_chunks_outside_the_prompt_or_overlapping_are_refused(llama, starts, why):
    model = HFLlama(llama)
    keys, values, _ = prefill_kv(llama, DOC_B[:8])
    chunks = [LoadedChunk(s, 0, keys, values) for s in starts]
    with pytest.raises(ValueError, match=why):
        blend_input(torch.arange(32), chunks, model.rope_shift(), torch.float32)
