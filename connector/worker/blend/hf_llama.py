"""transformers' ``LlamaForCausalLM`` behind the blender's per-layer interface, and its full
prefill's KV in the blender's layout: what the blend is validated against on the real model."""

from __future__ import annotations

import torch
from transformers.models.llama import modeling_llama

from .rope_shift import RopeShift, hf_rotate


class HFLlamaLayer:
    def __init__(self, layer: modeling_llama.LlamaDecoderLayer, rotary: torch.nn.Module) -> None:
        self._layer = layer
        self._rotary = rotary
        self.scaling = float(layer.self_attn.scaling)

    def qkv(
        self, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attn, x = self._layer.self_attn, self._layer.input_layernorm(hidden)
        shape = (x.shape[0], -1, attn.head_dim)
        q, k = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape)
        cos, sin = self._rotary(x[None], positions[None])
        q, k = modeling_llama.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        return q[0].transpose(0, 1), k[0].transpose(0, 1), attn.v_proj(x).view(shape)

    def finish(self, hidden: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self._layer.self_attn.o_proj(attention.reshape(attention.shape[0], -1))
        return hidden + self._layer.mlp(self._layer.post_attention_layernorm(hidden))


class HFLlama:
    def __init__(self, model: modeling_llama.LlamaForCausalLM) -> None:
        self.model = model
        inner = model.model
        self.layers = [HFLlamaLayer(layer, inner.rotary_emb) for layer in inner.layers]

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.model.embed_tokens(token_ids)

    def sum_across_ranks(self, per_rank: torch.Tensor) -> torch.Tensor:
        return per_rank  # one process holds every head

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(hidden))

    def rope_shift(self) -> RopeShift:
        rotary, config = self.model.model.rotary_emb, self.model.config
        params = getattr(config, "rope_parameters", None) or {}
        original = int(params.get("original_max_position_embeddings") or config.max_position_embeddings)
        return RopeShift(
            hf_rotate(rotary, modeling_llama.apply_rotary_pos_emb),
            config.head_dim,
            kind=str(params.get("rope_type", "default")),
            probe_at=min(original, config.max_position_embeddings - 64),
        )


@torch.no_grad()
def prefill_kv(
    model: modeling_llama.LlamaForCausalLM, token_ids: torch.Tensor, start: int = 0
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """A full prefill of ``token_ids`` at positions ``start``...: per layer K and V [T, Hkv, D]
    and the last token's logits."""
    positions = torch.arange(start, start + token_ids.shape[0])[None]
    out = model(input_ids=token_ids[None], position_ids=positions, use_cache=True)
    layers = out.past_key_values.layers
    keys = [layer.keys[0].transpose(0, 1).contiguous() for layer in layers]
    values = [layer.values[0].transpose(0, 1).contiguous() for layer in layers]
    return keys, values, out.logits[0, -1]
