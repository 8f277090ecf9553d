"""Stored K moved to new positions equals K rotated there, with vLLM's own rotary embeddings
(neox and gptj pairs, partial rotary, linear, YaRN and Llama 3 scaling) and transformers'."""

from __future__ import annotations

from functools import cache

import pytest
import torch

from connector.worker.blend.rope_shift import RopeNotShiftable, RopeShift, hf_rotate, vllm_rope_shift

HEAD_DIM, HEADS = 64, 3
SCALINGS = {
    "default": {"rope_theta": 10000.0, "rope_type": "default"},
    "partial": {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5},
    "linear": {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0},
    # vLLM's dynamic NTK is fixed for the largest length (transformers' changes with the sequence)
    "dynamic": {"rope_theta": 10000.0, "rope_type": "dynamic", "factor": 2.0},
    "yarn": {
        "rope_theta": 10000.0,
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
    },
    "llama3": {
        "rope_theta": 500000.0,
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    },
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@cache
def vllm_config():
    from vllm.config import VllmConfig

    return VllmConfig()


@cache
def vllm_rope(neox: bool, scaling: str, dtype: torch.dtype) -> torch.nn.Module:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(vllm_config()):
        return get_rope(
            HEAD_DIM, 4096, is_neox_style=neox, rope_parameters=dict(SCALINGS[scaling]), dtype=dtype
        )


def rotated(rope: torch.nn.Module, positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    flat = keys.reshape(keys.shape[0], -1)
    _, k = rope.forward_native(positions, flat[:, :HEAD_DIM].clone(), flat.clone())
    return k.reshape(keys.shape)


def keys(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(40, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1)).to(dtype)


@pytest.mark.parametrize("scaling", sorted(SCALINGS))
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("delta", [1, 377, -250, 2000])
def test_moving_k_by_a_delta_equals_k_rotated_at_the_new_positions(neox, scaling, delta):
    """fp32 tight: the reference's own angle (position x frequency in fp32) is off by about
    position x 1.2e-7 radians, 3e-4 at position 2,300 for K of norm 3."""
    rope = vllm_rope(neox, scaling, torch.float32)
    k, stored = keys(), torch.arange(40) + 300
    moved = vllm_rope_shift(rope).move(rotated(rope, stored, k), delta)
    torch.testing.assert_close(moved, rotated(rope, stored + delta, k), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
def test_moving_bf16_k_stays_within_bf16_rounding(neox):
    rope = vllm_rope(neox, "default", torch.bfloat16)
    k, stored = keys(torch.bfloat16), torch.arange(40) + 100
    moved = vllm_rope_shift(rope).move(rotated(rope, stored, k), 900)
    assert moved.dtype is torch.bfloat16
    torch.testing.assert_close(moved, rotated(rope, stored + 900, k), rtol=0.05, atol=0.05)


def test_a_zero_delta_leaves_k_as_it_is():
    rope = vllm_rope(True, "yarn", torch.float32)
    k = keys()
    assert vllm_rope_shift(rope).move(k, 0) is k


def test_transformers_rotary_moves_k_the_same_way():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=HEAD_DIM * HEADS, num_attention_heads=HEADS, head_dim=HEAD_DIM)
    rotate = hf_rotate(LlamaRotaryEmbedding(config), apply_rotary_pos_emb)
    k, stored = keys(), torch.arange(40) + 50
    for delta in (13, -50):
        moved = RopeShift(rotate, HEAD_DIM).move(rotate(stored, k), delta)
        torch.testing.assert_close(moved, rotate(stored + delta, k), rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize(
    "kind", ["longrope", "Phi3LongRoPEScaledRotaryEmbedding", "dynamic", "MRotaryEmbedding"]
)
def test_rope_variants_not_linear_in_position_are_refused_by_name(kind):
    rotate = vllm_rope_shift(vllm_rope(True, "default", torch.float32))._rotate
    with pytest.raises(RopeNotShiftable, match="not linear in position"):
        RopeShift(rotate, HEAD_DIM, kind=kind)


def test_a_rope_that_switches_frequencies_past_a_length_is_refused_by_the_probe():
    """As LongRoPE does (short factors below the original length, long ones past it), under a
    name the refusal list does not know."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))

    def rotate(positions: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        factor = torch.where(positions >= 1024, 2.0, 1.0)[:, None]
        angle = (positions[:, None].float() / factor) * inv
        cos, sin = angle.cos()[:, None], angle.sin()[:, None]
        first, second = k[..., : HEAD_DIM // 2], k[..., HEAD_DIM // 2 :]
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)

    with pytest.raises(RopeNotShiftable, match="differs"):
        RopeShift(rotate, HEAD_DIM, probe_at=1024)
