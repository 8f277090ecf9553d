"""What a token of prefill costs this engine, measured from its own steps.

"Prefill time saved" is tokens KVLens loaded times what computing them would have cost. The
cost is not a constant: it depends on the model, the hardware, the batch and the attention
backend, so it is measured here, on the live engine, from every step it runs:

- A step's duration is the time from its scheduling to the next step's scheduling, counted
  only when the engine was busy throughout (a request of the step is scheduled again in the
  next one, as a prompt continuing or its next decode), so idle gaps never count.
- A step's time is modelled as ``overhead + a * prefill + b * decode + c * loaded``: prompt
  tokens computed, decode tokens, and tokens KVLens loaded in the step. A weighted least-squares
  fit over the measured steps (exponential decay, ``half_life`` steps) gives ``a``, the cost of
  a prefill token, from mixed batches (decodes beside a prefill) and from engines whose every
  prompt hits (a warm restart) as well as from pure prefill steps.
- Until the fit pins ``a`` down there is no estimate ("unknown", never 0): too few steps, prefill
  that never varies apart from the loads, or a standard error above half the estimate. A regressor
  that never varies is left out (a pure-prefill workload of equal steps prices the overhead into
  ``a``, erring high as the earlier ratio of seconds over tokens did).

- Where the fit cannot separate prefill from the rest (equal-length prompts one at a time, cold
  ones then hits, keep prefill, loads and the overhead collinear for a long time), the cost is
  what the engine measured per request: a cold request's prefill time (its schedule to its
  first token, as vLLM's own ``request_prefill_time_seconds`` measures it) over its prompt
  tokens, for a request that ran alone and computed its whole prompt in one step (decayed
  average of at least ``MIN_COLD_REQUESTS``). Like the ratio of old it includes the step's
  overhead, so it errs high.

KVLens's own store work in a step is part of its time and grows with its prefill tokens, so the
estimate errs slightly high. Pure logic: no vLLM, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

# Regressors in the order the fit takes them: a later one that the earlier ones explain is
# dropped, so prefill collinear with loads or decodes means "unknown", and an overhead
# collinear with prefill (equal pure-prefill steps) is what gets dropped.
DECODE, LOADED, PREFILL, OVERHEAD = range(4)
_N = 4
_COLLINEAR = 1e-9  # a regressor whose part unexplained by the earlier ones is below this share
MIN_COLD_REQUESTS = 3  # cold requests timed alone before their average prices a token
_COLD_KEEP = 0.5 ** (1.0 / 32)  # their average's decay: a half-life of 32 requests


@dataclass(frozen=True, slots=True)
class _Step:
    at: float
    x: tuple[float, float, float, float]
    requests: frozenset[str]
    cold: bool = False  # one request alone computing its whole prompt from its first token


class PrefillCostMeter:
    def __init__(self, half_life: float = 256.0, min_steps: int = 8, max_rel_error: float = 0.5) -> None:
        if half_life <= 0 or min_steps < 2 or max_rel_error <= 0:
            raise ValueError("half_life > 0, min_steps >= 2 and max_rel_error > 0 are required")
        self._keep = 0.5 ** (1.0 / half_life)
        self._min_steps = min_steps
        self._max_rel_error = max_rel_error
        self._gram = [[0.0] * _N for _ in range(_N)]  # decayed sum of x x^T
        self._xy = [0.0] * _N  # decayed sum of x * seconds
        self._yy = 0.0
        self._weight = 0.0  # decayed count of measured steps
        self._weight2 = 0.0  # decayed sum of squared weights (for the effective count)
        self._prefill_steps = 0.0  # decayed count of measured steps that computed prefill
        self._last: _Step | None = None
        self._cached: float | None = None
        self._stale = False
        self.measured_steps = 0
        self._cold_seconds = 0.0  # decayed sums over cold requests timed alone
        self._cold_tokens = 0.0
        self.cold_requests = 0

    def step(
        self,
        at: float,
        prefill_tokens: int,
        total_tokens: int,
        requests: Collection[str],
        loaded_tokens: int = 0,
        cold_prompt: bool = False,
    ) -> None:
        """A step was scheduled at ``at`` (monotonic seconds): close the previous one, open this one.

        ``cold_prompt``: the step computes one request's whole prompt from its first token (no
        cache hit, no load), and nothing else: its time is that request's prefill time."""
        ids = frozenset(requests)
        last = self._last
        if last is not None and last.requests & ids and at > last.at:
            self._observe(last.x, at - last.at)
            if last.cold:
                self._cold(at - last.at, last.x[PREFILL])
        decode = max(total_tokens - prefill_tokens, 0)
        x = (float(decode), float(loaded_tokens), float(prefill_tokens), 1.0)
        cold = cold_prompt and len(ids) == 1 and decode == 0 and not loaded_tokens and prefill_tokens > 0
        self._last = _Step(at, x, ids, cold) if ids and total_tokens > 0 else None

    def finished(self, at: float, request: str) -> None:
        """``request`` finished at ``at``: if it ran alone as a cold prompt in the last step (one
        output token), that step's time is its prefill time; no later step closes it."""
        last = self._last
        if last is not None and last.cold and last.requests == {request} and at > last.at:
            self._cold(at - last.at, last.x[PREFILL])
            self._last = None

    def _cold(self, seconds: float, tokens: float) -> None:
        self._cold_seconds = self._cold_seconds * _COLD_KEEP + seconds
        self._cold_tokens = self._cold_tokens * _COLD_KEEP + tokens
        self.cold_requests += 1
        self._stale = True

    def _observe(self, x: tuple[float, ...], seconds: float) -> None:
        k = self._keep
        for i in range(_N):
            self._xy[i] = self._xy[i] * k + x[i] * seconds
            row = self._gram[i]
            for j in range(_N):
                row[j] = row[j] * k + x[i] * x[j]
        self._yy = self._yy * k + seconds * seconds
        self._weight = self._weight * k + 1.0
        self._weight2 = self._weight2 * k * k + 1.0
        self._prefill_steps = self._prefill_steps * k + (1.0 if x[PREFILL] > 0 else 0.0)
        self.measured_steps += 1
        self._stale = True

    @property
    def seconds_per_token(self) -> float | None:
        """The current estimate of a prefill token's cost; None while unknown."""
        if self._stale:
            self._cached = self._fit()
            if self._cached is None and self.cold_requests >= MIN_COLD_REQUESTS:
                self._cached = self._cold_seconds / self._cold_tokens
            self._stale = False
        return self._cached

    def saved(self, tokens: int) -> float | None:
        """Seconds of prefill that ``tokens`` loaded tokens saved; None while the cost is unknown."""
        cost = self.seconds_per_token
        return None if cost is None else tokens * cost

    def _fit(self) -> float | None:
        n_eff = self._weight**2 / self._weight2 if self._weight2 > 0 else 0.0
        if n_eff < self._min_steps or self._prefill_steps < self._min_steps / 2:
            return None
        kept = _independent(self._gram)
        if PREFILL not in kept:
            return None
        g = [[self._gram[i][j] for j in kept] for i in kept]
        inverse = _inverse(g)
        if inverse is None:
            return None
        beta = [sum(inverse[r][c] * self._xy[kept[c]] for c in range(len(kept))) for r in range(len(kept))]
        p = kept.index(PREFILL)
        a = beta[p]
        if a <= 0:
            return None
        rss = max(self._yy - sum(beta[r] * self._xy[kept[r]] for r in range(len(kept))), 0.0)
        dof = n_eff - len(kept)
        if dof <= 0:
            return None
        stderr = math.sqrt(max(rss / dof * inverse[p][p], 0.0))
        return a if stderr <= self._max_rel_error * a else None


def _independent(gram: list[list[float]]) -> list[int]:
    """Regressors, in order, that the earlier kept ones do not explain (Schur complements)."""
    kept: list[int] = []
    for k in range(_N):
        if gram[k][k] <= 0:
            continue
        if kept:
            inverse = _inverse([[gram[i][j] for j in kept] for i in kept])
            if inverse is None:
                continue
            cross = [gram[i][k] for i in kept]
            explained = sum(
                cross[r] * inverse[r][c] * cross[c] for r in range(len(kept)) for c in range(len(kept))
            )
            if gram[k][k] - explained <= _COLLINEAR * gram[k][k]:
                continue
        kept.append(k)
    return kept


def _inverse(m: list[list[float]]) -> list[list[float]] | None:
    """Gauss-Jordan inverse of a small matrix; None when it is singular."""
    n = len(m)
    a = [row[:] + [1.0 if i == j else 0.0 for j in range(n)] for i, row in enumerate(m)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        scale = a[col][col]
        a[col] = [v / scale for v in a[col]]
        for r in range(n):
            if r != col and a[r][col] != 0.0:
                f = a[r][col]
                a[r] = [v - f * w for v, w in zip(a[r], a[col], strict=True)]
    return [row[n:] for row in a]
