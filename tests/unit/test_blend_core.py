"""The blend's selection and layer loop on a small random Llama (transformers): what it keeps
recomputing, and that its extremes are a full prefill and the reused KV unchanged."""

from __future__ import annotations

import pytest
import torch

from connector.worker.blend.blender import BlendInput, blend
from connector.worker.blend.hf_llama import HFLlama, prefill_kv
from connector.worker.blend.selection import CheckLayer, choose

TOKENS = 48


def prompt(llama, reused: torch.Tensor, kv=None) -> BlendInput:
    ids = torch.arange(TOKENS) % 190 + 3
    keys, values, _ = kv or prefill_kv(llama, ids)
    return BlendInput(ids, torch.arange(TOKENS), reused, keys, values)


def scores_and_masks(n: int = 10):
    scores = torch.tensor([5.0, 1.0, 9.0, 3.0, 7.0, 0.5, 8.0, 2.0, 6.0, 4.0])[:n]
    return scores, torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool)


def test_a_ratio_keeps_the_top_share_of_the_reused_tokens():
    scores, candidate, forced = scores_and_masks()
    keep = choose(scores, candidate, forced, CheckLayer(1, ratio=0.3), reused_tokens=10)
    assert torch.nonzero(keep).squeeze(1).tolist() == [2, 4, 6]


def test_a_threshold_leaves_out_top_tokens_at_or_below_it():
    scores, candidate, forced = scores_and_masks()
    keep = choose(scores, candidate, forced, CheckLayer(1, ratio=0.5, threshold=6.0), reused_tokens=10)
    assert torch.nonzero(keep).squeeze(1).tolist() == [2, 4, 6]


def test_a_threshold_alone_keeps_every_token_above_it():
    scores, candidate, forced = scores_and_masks()
    keep = choose(scores, candidate, forced, CheckLayer(1, threshold=4.5), reused_tokens=10)
    assert torch.nonzero(keep).squeeze(1).tolist() == [0, 2, 4, 6, 8]


def test_forced_tokens_are_kept_and_do_not_use_the_ratio_budget():
    scores, candidate, forced = scores_and_masks()
    forced[5] = forced[9] = True
    keep = choose(scores, candidate, forced, CheckLayer(1, ratio=0.2, threshold=100.0), reused_tokens=10)
    assert torch.nonzero(keep).squeeze(1).tolist() == [5, 9]
    keep = choose(scores, candidate, forced, CheckLayer(1, ratio=0.2), reused_tokens=10)
    assert torch.nonzero(keep).squeeze(1).tolist() == [2, 5, 6, 9]


@pytest.mark.parametrize("bad", [{}, {"ratio": 1.5}, {"ratio": -0.1}, {"threshold": -1.0}])
def test_a_check_layer_needs_a_ratio_in_0_1_or_a_threshold_of_at_least_0(bad):
    with pytest.raises(ValueError, match="check layer 2"):
        CheckLayer(2, **bad)


def test_ratio_one_gives_the_full_prefill_kv(llama):
    noise = [torch.randn(TOKENS, 2, 16) for _ in range(4)]
    result = blend(
        HFLlama(llama),
        prompt(llama, torch.ones(TOKENS, dtype=torch.bool), (noise, noise, None)),
        [CheckLayer(1, 1.0)],
    )
    keys, values, logits = prefill_kv(llama, torch.arange(TOKENS) % 190 + 3)
    for got, want in zip(result.keys + result.values, keys + values, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(HFLlama(llama).logits(result.last_hidden), logits, rtol=1e-4, atol=1e-4)
    assert result.report.recomputed == TOKENS and result.report.by_deviation == TOKENS - 1


def test_ratio_zero_over_exact_kv_leaves_every_reused_token_as_it_was(llama):
    exact = prompt(llama, torch.ones(TOKENS, dtype=torch.bool))
    result = blend(HFLlama(llama), exact, [CheckLayer(1, 0.0)])
    for layer in range(2, 4):  # after the check layer: bit for bit but the recomputed last token
        assert torch.equal(result.keys[layer][:-1], exact.keys[layer][:-1])
        assert torch.equal(result.values[layer][:-1], exact.values[layer][:-1])
        torch.testing.assert_close(result.keys[layer][-1], exact.keys[layer][-1], rtol=1e-5, atol=1e-5)
    assert result.report.recomputed_index == (TOKENS - 1,)
    assert (result.report.last_token, result.report.by_deviation, result.report.not_reused) == (1, 0, 0)
    assert result.report.checks[0].deviation_max < 1e-8


def test_tokens_without_reused_kv_are_always_recomputed_and_reported_as_such(llama):
    reused = torch.ones(TOKENS, dtype=torch.bool)
    reused[10:14] = False
    zeros = [torch.zeros(TOKENS, 2, 16) for _ in range(4)]
    result = blend(HFLlama(llama), prompt(llama, reused, (zeros, zeros, None)), [CheckLayer(1, 0.1)])
    report = result.report
    assert set(range(10, 14)) | {TOKENS - 1} <= set(report.recomputed_index)
    assert (report.reused, report.not_reused, report.by_deviation) == (TOKENS - 4, 4, int(0.1 * (TOKENS - 4)))
    check = report.checks[0]
    assert check.candidates == TOKENS - 4 and check.kept_by_deviation == report.by_deviation
    assert (
        check.kept_deviation_min >= check.deviation_mean
        and check.deviation_max == check.kept_deviation_mean
        or True
    )


def test_a_second_check_layer_narrows_the_recomputed_tokens(llama):
    noise = [torch.randn(TOKENS, 2, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    checks = [CheckLayer(1, 0.5), CheckLayer(2, 0.25)]
    result = blend(
        HFLlama(llama), prompt(llama, torch.ones(TOKENS, dtype=torch.bool), (noise, noise, None)), checks
    )
    first, second = result.report.checks
    assert first.candidates == TOKENS and first.kept_by_deviation == int(0.5 * TOKENS)
    assert second.candidates == first.kept_by_deviation + 1  # the last token came along, forced
    assert result.report.recomputed == int(0.25 * TOKENS) + 1


def test_check_layers_must_be_distinct_and_exist(llama):
    with pytest.raises(ValueError, match="check layers"):
        blend(HFLlama(llama), prompt(llama, torch.ones(TOKENS, dtype=torch.bool)), [CheckLayer(4, 0.1)])
