"""Fixtures shared by the unit tests' modules."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def llama():
    """A small random Llama (transformers, fp32) for the blender's tests, on one thread."""
    from transformers import LlamaConfig, LlamaForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=200,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    yield LlamaForCausalLM(config).eval()
    torch.set_num_threads(threads)
