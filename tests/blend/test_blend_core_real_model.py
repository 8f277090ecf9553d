"""The blender's compute core on the real model (SmolLM2-135M-Instruct in fp32, transformers'
LlamaForCausalLM, no vLLM engine): its extremes are exact, and on a RAG-shaped prompt (LMCache's
blend flow, bench/lib/blend_quality.py) recomputing more brings the KV and the next-token logits
closer to a full prefill's. The figures themselves: bench/blend_core_quality.py."""

from __future__ import annotations

import pytest
import torch

from bench.lib import rag_set
from bench.lib.blend_quality import Measure, greedy_from_kv, measure, rag_prompt, reused_input
from connector.worker.blend.blender import BlendInput, blend
from connector.worker.blend.hf_llama import HFLlama, prefill_kv
from connector.worker.blend.selection import CheckLayer

RATIOS = (0.0, 0.15, 1.0)
STEPS = 8  # greedy tokens compared
ORDER = ("vacuum", "council", "travel")  # the three shortest documents: 563 tokens with the turns


@pytest.fixture(scope="module")
def smollm(real_model):
    from transformers import AutoTokenizer, LlamaForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = LlamaForCausalLM.from_pretrained(real_model, torch_dtype=torch.float32).eval()
    yield AutoTokenizer.from_pretrained(real_model), HFLlama(model)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def rag(smollm):
    """The full prefill of one RAG prompt, and the blend at each of ``RATIOS``."""
    tokenizer, model = smollm
    prompt = rag_prompt(tokenizer, rag_set.questions_for("council")[0], ORDER)
    full = prefill_kv(model.model, prompt.token_ids)
    reference = greedy_from_kv(model, full[0], full[1], prompt.token_ids, STEPS)
    reused = reused_input(model, prompt)
    measures = {r: measure(model, reused, full, r, STEPS) for r in RATIOS}
    return full, reference, measures


def test_ratio_one_gives_exactly_the_full_prefill_kv(rag, smollm):
    (keys, values, logits), reference, measures = rag
    result = measures[1.0].result
    assert result.report.recomputed == result.report.tokens
    for got, want in zip(result.keys + result.values, keys + values, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(smollm[1].logits(result.last_hidden), logits, rtol=1e-4, atol=1e-3)
    assert measures[1.0].greedy == reference


def test_ratio_zero_over_the_full_prefill_kv_leaves_it_unchanged(smollm):
    tokenizer, model = smollm
    ids = rag_prompt(tokenizer, rag_set.questions_for("council")[0], ORDER).token_ids[:160]
    keys, values, logits = prefill_kv(model.model, ids)
    every = BlendInput(
        ids, torch.arange(ids.shape[0]), torch.ones(ids.shape[0], dtype=torch.bool), keys, values
    )
    result = blend(model, every, [CheckLayer(1, 0.0)])
    assert result.report.recomputed_index == (ids.shape[0] - 1,)
    for layer in range(len(keys)):
        assert torch.equal(result.keys[layer][:-1], keys[layer][:-1])
        assert torch.equal(result.values[layer][:-1], values[layer][:-1])
        torch.testing.assert_close(result.keys[layer], keys[layer], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(result.values[layer], values[layer], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.logits(result.last_hidden), logits, rtol=1e-4, atol=1e-3)


def test_recomputing_more_brings_kv_and_logits_closer_to_full_prefill(rag):
    _, _, measures = rag
    by_ratio: list[Measure] = [measures[r] for r in RATIOS]
    for figure in ("k_error", "v_error", "logits_l2", "logits_kl"):
        values = [getattr(m, figure) for m in by_ratio]
        assert values[0] > values[1] > values[2], (figure, values)
    assert [m.recomputed for m in by_ratio] == sorted(m.recomputed for m in by_ratio)


def test_what_the_check_layer_chose_is_reported(rag):
    _, _, measures = rag
    report = measures[0.15].result.report
    check = report.checks[0]
    assert report.not_reused > 0  # the separators and the question
    assert check.candidates == report.reused
    assert check.kept_by_deviation == int(0.15 * report.reused) == report.by_deviation
    assert check.deviation_mean < check.kept_deviation_min <= check.kept_deviation_mean <= check.deviation_max
    assert report.recomputed == report.not_reused + report.by_deviation + report.last_token
