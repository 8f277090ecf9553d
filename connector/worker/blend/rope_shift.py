"""Moving stored K to new positions: a RoPE rotation by the position delta, made by the model's own
rotary embedding so its style (neox or gptj pairs), partial rotary dimensions and scaling apply.

A rotary embedding is linear in K for fixed positions, so the map it applies at position ``d`` is
a matrix ``M_d`` we read by rotating the identity. ``M_d = S R(d)``: ``S = M_0`` is the constant
per-dimension magnitude some variants put in cos and sin (YaRN's mscale; 1 on dimensions that are
not rotated), ``R(d)`` a pure rotation. K stored at position ``p`` is ``S R(p) k``; where the angle
is linear in position (plain RoPE, linear, NTK, YaRN and Llama 3 scaling) ``R(d) R(p) = R(p+d)``,
so the moved K is ``S^-1 M_d K`` for ``d >= 0`` and ``M_|d|^T S^-1 K`` for ``d < 0`` (``R`` is
orthogonal). Variants whose angle is not linear in position (LongRoPE's short/long factors,
dynamic NTK that depends on the sequence length, multi-axis mRoPE) are refused: their segments
are computed, not moved. A probe also checks the composition numerically before trusting it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch

# positions [T], keys [T, H, D] -> keys rotated at those positions, same shape
Rotate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# transformers' rope types and parts of vLLM's class names whose angle is not linear in position.
# transformers' "dynamic" NTK changes with the sequence length; vLLM's is fixed for the largest
# length (``DynamicNTKScalingRotaryEmbedding``) and moves like any other.
NOT_SHIFTABLE_TYPES = ("longrope", "dynamic", "mrope")
NOT_SHIFTABLE_CLASSES = ("longrope", "mrotary", "dualchunk")


class RopeNotShiftable(ValueError):
    """The model's RoPE cannot move stored K by a delta: reuse must fall back to compute."""


class RopeShift:
    """Moves K by position deltas with one model's rotary embedding (one per model, shared by its
    layers: RoPE has no weights). Matrices are made once per distinct delta, in fp32."""

    def __init__(self, rotate: Rotate, head_dim: int, *, kind: str = "", probe_at: int = 1024) -> None:
        name = kind.lower()
        bad = (
            name
            if name in NOT_SHIFTABLE_TYPES
            else next((c for c in NOT_SHIFTABLE_CLASSES if c in name), None)
        )
        if bad is not None:
            raise RopeNotShiftable(f"RoPE {kind!r} is not linear in position ({bad}): compute instead")
        self._rotate = rotate
        self._head_dim = head_dim
        self._matrix = lru_cache(maxsize=256)(self._make_matrix)
        self._scale = torch.diagonal(self._matrix(0)).clone()
        if bool((self._scale == 0).any()):
            raise RopeNotShiftable(f"RoPE {kind!r} zeroes dimensions at position 0")
        self._check_composes(probe_at)

    def _make_matrix(self, position: int) -> torch.Tensor:
        eye = torch.eye(self._head_dim, dtype=torch.float32).unsqueeze(1)  # [D tokens, 1 head, D]
        positions = torch.full((self._head_dim,), position, dtype=torch.long)
        return self._rotate(positions, eye).squeeze(1).to(torch.float32).T  # column j = M e_j

    def _check_composes(self, probe_at: int) -> None:
        """Rotating at ``a`` then moving by ``b`` must equal rotating at ``a + b``, around 0 and
        around ``probe_at`` (give the model's original context length: where a LongRoPE switches
        factors; it must stay below the rotary's largest position), both ways."""
        probe = torch.randn(1, 1, self._head_dim, generator=torch.Generator().manual_seed(0))
        for a, b in ((3, 5), (8, -5), (probe_at - 7, 11), (probe_at + 9, -13), (0, probe_at + 1)):
            raw = self._rotate(torch.tensor([a + b]), probe)
            tol = max(1e-4, torch.finfo(raw.dtype).eps * 32)
            want = raw.to(torch.float32)
            got = self.move(self._rotate(torch.tensor([a]), probe).to(torch.float32), b)
            if not torch.allclose(got, want, rtol=tol, atol=tol * float(want.abs().max())):
                raise RopeNotShiftable(f"RoPE rotation at {a} moved by {b} differs from rotation at {a + b}")

    def move(self, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """``keys`` ([T, H, D], rotated at their stored positions) at ``delta`` further on; the
        result has the keys' dtype, computed in fp32."""
        if delta == 0:
            return keys
        matrix = self._matrix(abs(delta))
        op = matrix / self._scale[:, None] if delta > 0 else matrix.T / self._scale[None, :]
        return (keys.to(torch.float32) @ op.T).to(keys.dtype)


def vllm_rotate(rotary_emb: torch.nn.Module) -> Rotate:
    """vLLM's ``RotaryEmbedding`` family: ``forward_native(positions, query, key)`` on K flattened
    to [T, H*D]; the query is a dummy of one head (the native path, the same cos_sin_cache the
    model's kernels read)."""

    def rotate(positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        tokens, heads, dim = keys.shape
        cache = rotary_emb.cos_sin_cache
        flat = keys.reshape(tokens, heads * dim).to(cache.dtype)
        _, rotated = rotary_emb.forward_native(positions, flat[:, :dim].clone(), flat.clone())
        return rotated.reshape(tokens, heads, dim)

    return rotate


def hf_rotate(rotary_emb: torch.nn.Module, apply_rotary_pos_emb: Callable) -> Rotate:
    """transformers' rotary module (``forward(x, position_ids) -> cos, sin``) with the model's own
    ``apply_rotary_pos_emb`` (layout [B, H, T, D])."""

    def rotate(positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        k = keys.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
        cos, sin = rotary_emb(k, positions.unsqueeze(0))
        _, rotated = apply_rotary_pos_emb(k, k, cos, sin)
        return rotated.squeeze(0).transpose(0, 1)

    return rotate


def vllm_rope_shift(rotary_emb: torch.nn.Module) -> RopeShift:
    """The shift for a vLLM model's ``rotary_emb``, probed halfway to its largest position."""
    return RopeShift(
        vllm_rotate(rotary_emb),
        int(rotary_emb.head_size),
        kind=type(rotary_emb).__name__,
        probe_at=int(rotary_emb.max_position_embeddings) // 2,
    )
