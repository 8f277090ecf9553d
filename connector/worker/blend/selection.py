"""Which tokens a check layer keeps recomputing, by the deviation of their reused K.

The deviation is LMCache's (``lmcache/v1/compute/blend/blender.py``): the squared L2 distance
between a token's freshly computed K and its reused (moved) K, summed over the KV heads and the
head dimension, in fp32. Its unit is the model's K scale squared, so a threshold is per model.

How a ratio and a threshold combine (LMCache reads only the first ratio and no threshold):
the ratio is a cap, the threshold a floor. ``count = int(ratio * reused_tokens)`` (the prompt's
reused tokens, not all its tokens, so separators and the question do not raise the budget), the
top ``count`` by deviation among the candidates are kept, and of those only the ones whose
deviation is above the threshold when one is given. A threshold alone keeps every candidate above
it. Tokens without reused KV and the prompt's last token are kept whatever their deviation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class CheckLayer:
    layer: int  # the layer whose fresh K is compared with the reused K
    ratio: float | None = None  # cap: share of the prompt's reused tokens kept (None: no cap)
    threshold: float | None = None  # floor: deviation a kept token must exceed (None: none)

    def __post_init__(self) -> None:
        if self.ratio is None and self.threshold is None:
            raise ValueError(f"check layer {self.layer}: a ratio, a threshold or both")
        if self.ratio is not None and not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"check layer {self.layer}: ratio {self.ratio} outside 0-1")
        if self.threshold is not None and self.threshold < 0:
            raise ValueError(f"check layer {self.layer}: threshold {self.threshold} below 0")


def deviation(fresh_k: torch.Tensor, reused_k: torch.Tensor) -> torch.Tensor:
    """Per token [n] from K [n, H, D] each."""
    return ((fresh_k.to(torch.float32) - reused_k.to(torch.float32)) ** 2).sum(dim=(1, 2))


def choose(
    scores: torch.Tensor, candidate: torch.Tensor, forced: torch.Tensor, check: CheckLayer, reused_tokens: int
) -> torch.Tensor:
    """Kept tokens [n] (bool): ``forced`` ones, and ``candidate`` ones picked by ``scores`` [n]."""
    keep = forced.clone()
    pool = torch.nonzero(candidate & ~forced).squeeze(1)
    if pool.numel() == 0:
        return keep
    count = pool.numel() if check.ratio is None else min(pool.numel(), int(check.ratio * reused_tokens))
    top = pool[torch.topk(scores[pool], k=count).indices] if count else pool[:0]
    if check.threshold is not None:
        top = top[scores[top] > check.threshold]
    keep[top] = True
    return keep


@dataclass(frozen=True, slots=True)
class CheckReport:
    layer: int
    candidates: int  # reused tokens still recomputed when the layer was reached
    kept_by_deviation: int
    deviation_mean: float  # over the candidates
    deviation_max: float
    kept_deviation_min: float  # the lowest deviation kept (0.0 when none was)
    kept_deviation_mean: float


def report(layer: int, scores: torch.Tensor, candidate: torch.Tensor, chosen: torch.Tensor) -> CheckReport:
    """What a check layer measured and chose (``chosen``: kept by deviation, not forced)."""
    seen, kept = scores[candidate], scores[chosen]
    return CheckReport(
        layer=layer,
        candidates=int(seen.numel()),
        kept_by_deviation=int(kept.numel()),
        deviation_mean=float(seen.mean()) if seen.numel() else 0.0,
        deviation_max=float(seen.max()) if seen.numel() else 0.0,
        kept_deviation_min=float(kept.min()) if kept.numel() else 0.0,
        kept_deviation_mean=float(kept.mean()) if kept.numel() else 0.0,
    )
