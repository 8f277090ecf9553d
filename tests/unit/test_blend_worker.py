"""The worker's half of a blend (small random Llama through transformers, fp32; a CPU tier): what
it reads, writes into the request's blocks and stores, and what it does with a record it cannot
use or a model it cannot blend."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from connector.engine.blend_jobs import BlendJob, SegmentChunkJob
from connector.engine.keys import storage_name
from connector.engine.outcomes import FailureReason
from connector.tiers.cpu import CpuTier
from connector.worker.blend.blend_worker import WorkerBlend
from connector.worker.blend.hf_llama import HFLlama, prefill_kv
from connector.worker.blend.selection import CheckLayer
from connector.worker.blend.vllm_llama import NotBlendable

from .test_blend_output import RecordingAttention

BLOCK = 4
DOC = [20 + (i * 7) % 150 for i in range(12)]
SEP = [7, 7]
NAME = "ab" * 16


def backing(llama, ratio: float = 1.0):
    model = HFLlama(llama)
    layers = llama.config.num_hidden_layers
    return SimpleNamespace(
        model=model,
        attention=[RecordingAttention() for _ in range(layers)],
        shift=model.rope_shift(),
        max_positions=llama.config.max_position_embeddings,
        dtype=torch.float32,
        checks=[CheckLayer(1, ratio=ratio)],
        empty_kv=lambda count: [torch.zeros(count, 2, 16) for _ in range(layers)],
    )


def worker(make_backing, tiers=None) -> WorkerBlend:
    tiers = tiers if tiers is not None else {"cpu": CpuTier()}

    def put(tier, name, payload, namespace, tokens):
        tiers[tier].put(name, payload, namespace)

    return WorkerBlend(0, BLOCK, tiers, lambda tier: True, put, make_backing)


def job(rid: str, ids: list[int], start: int, tier: str | None, store_to=()) -> BlendJob:
    blocks = tuple(range(100, 100 + -(-len(ids) // BLOCK)))
    chunk = SegmentChunkJob(NAME, start, len(DOC), tier, tuple(store_to))
    return BlendJob(rid, tuple(ids), blocks, 0, (chunk,))


def written(attention) -> torch.Tensor:
    """Layer 0's K as written, by slot order."""
    ((key, _, _),) = attention[0].calls
    return key


def test_a_document_computed_once_is_stored_then_reused_at_another_position(llama):
    made = backing(llama)
    blend_worker = worker(lambda: made)
    (first,) = blend_worker.run([job("a", DOC + SEP, 0, None, ["cpu"])])
    assert first.failed is None and first.stored == 1 and first.reused_by_tier == {}
    assert storage_name(NAME, 0) in blend_worker.tiers["cpu"]._chunks
    ids = [3, 4, 5, *SEP, *DOC, *SEP, 9, 10]
    made.attention = [RecordingAttention() for _ in made.attention]
    (second,) = blend_worker.run([job("b", ids, 5, "cpu")])
    assert second.failed is None and second.reused_by_tier == {"cpu": len(DOC)}
    assert second.written_tokens == len(ids) - 1 and second.stored == 0
    k, _, _ = prefill_kv(llama, torch.tensor(ids))  # ratio 1: every token recomputed
    torch.testing.assert_close(written(made.attention), k[0][:-1], rtol=1e-4, atol=1e-4)


def test_a_record_of_the_wrong_size_is_computed_counted_and_named(llama):
    made = backing(llama)
    blend_worker = worker(lambda: made)
    blend_worker.tiers["cpu"].put(storage_name(NAME, 0), memoryview(b"\0" * 64))
    ids = [3, *SEP, *DOC]
    (outcome,) = blend_worker.run([job("a", ids, 3, "cpu")])
    assert outcome.failed is None and outcome.reused_by_tier == {}
    assert [p.reason for p in outcome.problems] == [FailureReason.CORRUPT]
    k, _, _ = prefill_kv(llama, torch.tensor(ids))
    torch.testing.assert_close(written(made.attention), k[0][:-1], rtol=1e-4, atol=1e-4)


def test_a_missing_record_is_computed_and_a_miss_on_the_remote_is_no_problem(llama):
    made = backing(llama)
    tiers = {"cpu": CpuTier(), "remote": CpuTier()}
    ids = [3, *SEP, *DOC]
    (local,) = worker(lambda: made, tiers).run([job("a", ids, 3, "cpu")])
    assert [p.reason for p in local.problems] == [FailureReason.MISSING]
    (remote,) = worker(lambda: made, tiers).run([job("b", ids, 3, "remote", ["cpu", "remote"])])
    assert remote.problems == [] and remote.stored == 1  # computed, then stored in both
    assert storage_name(NAME, 0) in tiers["remote"]._chunks


def test_a_model_the_blender_cannot_run_fails_the_blocks_and_the_admitted_stores(llama):
    def refuse():
        raise NotBlendable("not a Llama")

    blend_worker = worker(refuse)
    ids = [3, *SEP, *DOC]
    (outcome,) = blend_worker.run([job("a", ids, 3, None, ["cpu"])])
    assert "not a Llama" in outcome.failed
    assert outcome.failed_block_ids == [100, 101, 102, 103]  # tokens 0-14 of 15: vLLM computes them
    (failure,) = blend_worker.take_store_failures()
    assert (failure.name, failure.tier) == (NAME, "cpu")
    (again,) = blend_worker.run([job("b", ids, 3, None)])  # said once, then every blend fails
    assert again.failed is not None


@pytest.mark.parametrize("first", [0, 4, 8])
def test_only_the_tokens_vllm_does_not_hold_are_written(llama, first):
    made = backing(llama)
    ids = [3, *SEP, *DOC]
    blocks = tuple(range(100, 104))
    blend = BlendJob("a", tuple(ids), blocks, first, (SegmentChunkJob(NAME, 3, len(DOC), None),))
    (outcome,) = worker(lambda: made).run([blend])
    assert outcome.written_tokens == len(ids) - 1 - first
    ((_, _, slots),) = made.attention[0].calls
    assert slots == [blocks[i // BLOCK] * BLOCK + i % BLOCK for i in range(first, len(ids) - 1)]
