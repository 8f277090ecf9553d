"""The blend: a prompt's KV from reused segments fixed up by recomputing a few tokens.

Every layer up to the first check layer is computed for every token (the check needs fresh K,
which needs every token's hidden state), so the KV written for those layers is the fresh KV,
exactly a full prefill's. At a check layer the reused tokens whose K deviates most stay
recomputed; the rest stop there. In each later layer only the recomputed tokens' hidden states
are computed, and they attend causally to the mixed KV: reused K and V for the others, fresh for
themselves. Tokens without reused KV (separators, the question, segments not stored or too
short) and the prompt's last token are always recomputed. Under tensor parallelism each rank
holds its own KV heads, so a token's deviation is summed over the ranks before the choice: every
rank keeps the same tokens, as the all-reduces of the later layers need. What comes out is, per
layer, K and V for every token: what the paged cache would hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .model_api import BlendModel
from .selection import CheckLayer, CheckReport, choose, deviation, report


@dataclass(frozen=True)
class BlendInput:
    token_ids: torch.Tensor  # [T] the prompt
    positions: torch.Tensor  # [T] where each token sits in it
    reused: torch.Tensor  # [T] bool: the token has reused KV (already moved to its position)
    keys: Sequence[torch.Tensor]  # per layer [T, Hkv, D]; rows of tokens not reused are ignored
    values: Sequence[torch.Tensor]


@dataclass(frozen=True, slots=True)
class BlendReport:
    tokens: int
    reused: int
    recomputed: int  # in the last layer
    not_reused: int  # recomputed because no KV was reused for them
    last_token: int  # 1 when the last token was reused and kept only because it is last
    by_deviation: int  # reused tokens kept by the check layers
    checks: tuple[CheckReport, ...]
    recomputed_index: tuple[int, ...]  # prompt indices recomputed in the last layer


@dataclass(frozen=True)
class BlendResult:
    keys: list[torch.Tensor]  # per layer [T, Hkv, D]
    values: list[torch.Tensor]
    last_hidden: torch.Tensor  # [E] the last token's residual stream out of the last layer
    report: BlendReport


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_index: torch.Tensor, scaling: float
) -> torch.Tensor:
    """q [n, Hq, D] of the prompt's tokens ``query_index`` [n] over k, v [T, Hkv, D] of every
    token, each query seeing the tokens up to itself -> [n, Hq, D]."""
    mask = torch.arange(k.shape[0], device=k.device)[None, :] <= query_index[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.to(q.dtype).transpose(0, 1)[None],
        v.to(q.dtype).transpose(0, 1)[None],
        attn_mask=mask,
        scale=scaling,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _check_plan(checks: Sequence[CheckLayer], layers: int) -> dict[int, CheckLayer]:
    plan = {c.layer: c for c in checks}
    if len(plan) != len(checks) or any(not 0 <= c.layer < layers for c in checks):
        raise ValueError(f"check layers {[c.layer for c in checks]}: distinct, in 0-{layers - 1}")
    return plan


@torch.no_grad()
def blend(model: BlendModel, prompt: BlendInput, checks: Sequence[CheckLayer]) -> BlendResult:
    plan = _check_plan(checks, len(model.layers))
    count = prompt.token_ids.shape[0]
    reused = prompt.reused.clone()
    forced = ~reused
    forced[-1] = True
    active = torch.arange(count)
    by_deviation = torch.zeros(count, dtype=torch.bool)
    hidden = model.embed(prompt.token_ids)
    keys, values, reports = [], [], []
    for number, layer in enumerate(model.layers):
        q, k, v = layer.qkv(hidden, prompt.positions[active])
        layer_k = prompt.keys[number].to(k.dtype).clone()
        layer_v = prompt.values[number].to(v.dtype).clone()
        layer_k[active], layer_v[active] = k, v
        keep = torch.ones(active.numel(), dtype=torch.bool)
        if number in plan:
            scores = model.sum_across_ranks(deviation(k, prompt.keys[number][active]))
            candidate = reused[active]
            keep = choose(scores, candidate, forced[active], plan[number], int(reused.sum()))
            chosen = keep & candidate & ~forced[active]
            reports.append(report(number, scores, candidate, chosen))
            by_deviation[active] = chosen
            q, hidden, active = q[keep], hidden[keep], active[keep]
        attention = causal_attention(q, layer_k, layer_v, active, layer.scaling)
        hidden = layer.finish(hidden, attention)
        keys.append(layer_k)
        values.append(layer_v)
    last_reused = bool(reused[-1]) and not bool(by_deviation[-1])
    summary = BlendReport(
        tokens=count,
        reused=int(reused.sum()),
        recomputed=int(active.numel()),
        not_reused=int((~reused).sum()),
        last_token=int(last_reused),
        by_deviation=int(by_deviation[active].sum()),
        checks=tuple(reports),
        recomputed_index=tuple(int(i) for i in active),
    )
    return BlendResult(keys, values, hidden[-1], summary)
