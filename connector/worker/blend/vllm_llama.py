"""vLLM's own Llama modules behind the blender's per-layer interface (``model_api``).

The blender runs the model vLLM loaded, in the worker, with the weights, kernels and tensor
parallel layout vLLM gave it: ``qkv`` is the layer's input norm, ``qkv_proj`` (column parallel:
this rank's heads) and ``rotary_emb`` (the model's own RoPE variant); ``finish`` is ``o_proj`` and
the MLP (row parallel: each ends in vLLM's all-reduce, so every rank must call it in step) with
the residual adds and the post-attention norm. vLLM's decoder layer carries the residual beside
the normed stream (its fused add-and-norm); the blender carries their sum, which is what that
fused norm computes first, so the two agree up to the rounding of one add.

Llama-like models whose layers have these modules (Llama, Mistral, Qwen2 and others built the
same way) are backed; anything else is refused by name (``NotBlendable``), and its requests are
computed, never blended.
"""

from __future__ import annotations

from typing import Any

import torch


class NotBlendable(Exception):
    """The loaded model lacks what the blender needs (named in the message)."""


ATTENTION_PARTS = ("qkv_proj", "o_proj", "rotary_emb", "q_size", "kv_size", "head_dim", "scaling")
LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn")


class VllmLlamaLayer:
    def __init__(self, layer: Any) -> None:
        self._layer = layer
        self._attn = attn = layer.self_attn
        self.scaling = float(attn.scaling)
        self._split = [int(attn.q_size), int(attn.kv_size), int(attn.kv_size)]
        self._head_dim = int(attn.head_dim)

    def qkv(
        self, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self._layer.input_layernorm(hidden)
        qkv, _ = self._attn.qkv_proj(x)
        q, k, v = qkv.split(self._split, dim=-1)
        q, k = self._attn.rotary_emb(positions, q, k)
        shape = (x.shape[0], -1, self._head_dim)
        return q.reshape(shape), k.reshape(shape), v.reshape(shape)

    def finish(self, hidden: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        out, _ = self._attn.o_proj(attention.reshape(attention.shape[0], -1))
        hidden = hidden + out
        return hidden + self._layer.mlp(self._layer.post_attention_layernorm(hidden))


class VllmLlama:
    """``model``: the ``nn.Module`` vLLM's loader returned (``LlamaForCausalLM`` and kin)."""

    def __init__(self, model: Any) -> None:
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if inner is None or layers is None or not hasattr(inner, "embed_tokens"):
            raise NotBlendable(f"{type(model).__name__}: no model.layers / model.embed_tokens")
        start, end = getattr(inner, "start_layer", 0), getattr(inner, "end_layer", len(layers))
        if (start, end) != (0, len(layers)):
            raise NotBlendable(f"{type(model).__name__}: pipeline parallel (layers {start}-{end})")
        for number, layer in enumerate(layers):
            missing = [p for p in LAYER_PARTS if not hasattr(layer, p)]
            missing += [p for p in ATTENTION_PARTS if not hasattr(getattr(layer, "self_attn", None), p)]
            if missing:
                raise NotBlendable(f"{type(model).__name__} layer {number}: no {', '.join(missing)}")
        self.model = model
        self.layers = [VllmLlamaLayer(layer) for layer in layers]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(token_ids)

    def sum_across_ranks(self, per_rank: torch.Tensor) -> torch.Tensor:
        """vLLM's all-reduce over the tensor-parallel group (each rank holds its KV heads)."""
        from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce

        if get_tensor_model_parallel_world_size() == 1:
            return per_rank
        return tensor_model_parallel_all_reduce(per_rank.contiguous())

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of residual-stream rows ``hidden`` [n, E] (the final norm, then the head)."""
        return self.model.compute_logits(self.model.model.norm(hidden))
