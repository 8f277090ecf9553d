"""The blender on the model vLLM loaded (issue 39 items 2-3): KVLens's vLLM plugin remembers the
model the loader built, and ``VllmLlama`` runs its own modules (projections, the model's RoPE,
norms, MLP; vLLM's all-reduces under tensor parallelism) in the blender's layer loop. With every
token recomputed the result is a full prefill: each rank's K and V heads and the next-token
logits equal transformers' prefill of the same checkpoint (the tiny Llama, fp32), with one rank
and with two (TP=2 on the CPU backend, one KV head each). Written into vLLM's paged cache with the
backend's own write (``paged_write``), that KV is what vLLM decodes from: over the blocks of its
prefix cache, zeroed then rewritten by the blender, it answers as it did from its own prefill.
With KV reused, every rank keeps recomputing the same tokens: each computes a token's deviation on
its own heads, and the blender sums them over the ranks before choosing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.blend.vllm_backing import EVERY_HEAD, REUSED
from tests.integration.conftest import run_engine

pytestmark = pytest.mark.integration

RUNNER = Path(__file__).with_name("vllm_backing.py")
TOKENS = [(7 * i) % 250 + 4 for i in range(300)]
CACHED = 256  # vLLM's prefix cache keeps the prompt's whole blocks (128 tokens each on CPU)
FP32 = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(scope="module")
def transformers_prefill(tiny_model):
    """transformers' full prefill of ``TOKENS``: per layer K and V [T, Hkv, D], and the logits."""
    from transformers import LlamaForCausalLM

    from connector.worker.blend.hf_llama import prefill_kv

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = LlamaForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
        return prefill_kv(model, torch.tensor(TOKENS))
    finally:
        torch.set_num_threads(threads)


def blended_on_every_rank(model: str, tmp: Path, engine: dict, env: dict[str, str] | None = None) -> dict:
    """The runner's result: ``ranks`` (each rank's full-recompute blend), ``selected`` and
    ``rewrite``."""
    spec = {"model": model, "tokens": TOKENS, "cached": CACHED, "engine": engine}
    return run_engine(spec, tmp, env=env, runner=RUNNER, result="ranks")


def assert_every_rank_keeps_the_top_tokens_over_all_heads(selected: list[list[int]]) -> None:
    want = sorted([*EVERY_HEAD, *range(REUSED, len(TOKENS))])  # the top share and the unreused
    assert all(sorted(got) == want for got in selected), selected


def assert_vllm_decodes_the_blenders_kv(rewrite: dict, ranks: int) -> None:
    plain, zeroed, blended = rewrite["plain"], rewrite["zeroed"], rewrite["blended"]
    assert rewrite["written"] == [CACHED] * ranks
    assert zeroed["cached"] == blended["cached"] == CACHED  # both answered from vLLM's prefix cache
    first_zeroed, first_plain = zeroed["tops"][0], plain["tops"][0]
    assert first_zeroed != pytest.approx(first_plain, abs=1e-2), "zeroed KV changed nothing: not read"
    assert blended["tokens"] == plain["tokens"]
    for got, want in zip(blended["tops"], plain["tops"], strict=True):
        assert got == pytest.approx(want, abs=1e-3)


def test_the_blender_on_vllms_loaded_model_computes_transformers_full_prefill(
    tiny_model, transformers_prefill, tmp_path
):
    keys, values, logits = transformers_prefill
    run = blended_on_every_rank(tiny_model, tmp_path, {"dtype": "float32"})
    (rank,) = run["ranks"]
    assert rank["remembered"], "the plugin did not remember the model vLLM loaded"
    assert rank["recomputed"] == len(TOKENS)
    for got, want in zip(rank["keys"] + rank["values"], keys + values, strict=True):
        torch.testing.assert_close(torch.tensor(got), want, **FP32)
    torch.testing.assert_close(torch.tensor(rank["logits"]), logits, **FP32)
    assert_every_rank_keeps_the_top_tokens_over_all_heads(run["selected"])
    assert_vllm_decodes_the_blenders_kv(run["rewrite"], ranks=1)


def test_under_tensor_parallelism_each_rank_computes_its_own_kv_heads(
    tiny_model, transformers_prefill, tmp_path
):
    keys, values, logits = transformers_prefill
    engine = {"dtype": "float32", "tensor_parallel_size": 2}
    run = blended_on_every_rank(tiny_model, tmp_path, engine, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    ranks = run["ranks"]
    assert len(ranks) == 2 and all(r["remembered"] for r in ranks)
    for number, rank in enumerate(ranks):  # two KV heads: one per rank, in order
        heads = slice(number, number + 1)
        for got, want in zip(rank["keys"] + rank["values"], keys + values, strict=True):
            torch.testing.assert_close(torch.tensor(got), want[:, heads], **FP32)
        torch.testing.assert_close(torch.tensor(rank["logits"]), logits, **FP32)  # after the all-reduces
    assert_every_rank_keeps_the_top_tokens_over_all_heads(run["selected"])
    assert_vllm_decodes_the_blenders_kv(run["rewrite"], ranks=2)
