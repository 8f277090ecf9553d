"""What the blender needs from a decoder-only Llama-like model, one layer at a time.

Two steps per layer, split where tensor parallelism splits them: ``qkv`` (input norm, the Q/K/V
projections, RoPE at the given positions: per rank, its own heads) and ``finish`` (output
projection, residual, post-attention norm, MLP, residual: both projections end in an all-reduce
under TP). Attention between them is the blender's own (``blender.causal_attention``) over the
mixed KV, so every rank runs the same steps on the same token indices. transformers' Llama backs
it now (``hf_llama``); vLLM's Llama modules (``qkv_proj``, ``rotary_emb``, ``o_proj``, ``mlp``,
the layernorms) are to back it in the worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class BlendLayer(Protocol):
    scaling: float  # the attention's softmax scale (head_dim ** -0.5 for Llama)

    def qkv(
        self, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``hidden`` [n, E] (the residual stream into the layer) at ``positions`` [n] ->
        q [n, Hq, D], k [n, Hkv, D] (both rotated), v [n, Hkv, D]."""
        ...

    def finish(self, hidden: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """The residual stream out of the layer [n, E] from its input and the attention [n, Hq, D]."""
        ...


class BlendModel(Protocol):
    layers: Sequence[BlendLayer]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [n] -> the residual stream into layer 0 [n, E]."""
        ...

    def sum_across_ranks(self, per_rank: torch.Tensor) -> torch.Tensor:
        """The sum over tensor-parallel ranks of a tensor each rank computed on its own heads (a
        token's deviation): every rank must get the same, or they keep different tokens."""
        ...
