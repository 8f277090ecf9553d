"""What a token of prefill costs this engine, measured from its own steps.

"Prefill time saved" is tokens KVLens loaded times what computing them would have cost. The
cost is not a constant: it depends on the model, the hardware, the batch and the attention
backend, so it is measured here, on the live engine, from steps that computed prefill:

- A step's duration is the time from its scheduling to the next step's scheduling, counted
  only when the engine was busy throughout (a request of the step is scheduled again in the
  next one, as a prompt continuing or its first decode), so idle gaps never count.
- Only *cold prefill* steps are measured: at least ``prefill_share`` of the step's tokens are
  prompt tokens being computed (not decode), at least ``min_tokens`` of them, and nothing was
  loaded by KVLens in that step (a load would add its own time).
- The cost per token is seconds over tokens, summed over the measured steps with exponential
  decay (``half_life`` steps), so it follows changes in the workload (longer prompts cost more
  per token under attention's quadratic term) without jumping on one odd step.

The measured steps include what KVLens spends storing that step's chunks, which is small next
to the forward pass and is shown separately on the dashboards; the estimate therefore errs
slightly high. Pure logic: no vLLM, no torch.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class _Step:
    at: float
    tokens: int
    requests: frozenset[str]
    measured: bool  # a cold prefill step


class PrefillCostMeter:
    def __init__(self, min_tokens: int = 64, prefill_share: float = 0.9, half_life: float = 64.0) -> None:
        if min_tokens < 1 or not 0 < prefill_share <= 1 or half_life <= 0:
            raise ValueError("min_tokens >= 1, 0 < prefill_share <= 1 and half_life > 0 are required")
        self._min_tokens = min_tokens
        self._share = prefill_share
        self._keep = 0.5 ** (1.0 / half_life)
        self._seconds = 0.0
        self._tokens = 0.0
        self._last: _Step | None = None
        self.measured_steps = 0

    def step(
        self, at: float, prefill_tokens: int, total_tokens: int, requests: Collection[str], loads: bool
    ) -> None:
        """A step was scheduled at ``at`` (monotonic seconds): close the previous one, open this one."""
        ids = frozenset(requests)
        last = self._last
        if last is not None and last.measured and last.requests & ids and at > last.at:
            self._seconds = self._seconds * self._keep + (at - last.at)
            self._tokens = self._tokens * self._keep + last.tokens
            self.measured_steps += 1
        cold = (
            not loads
            and prefill_tokens >= self._min_tokens
            and prefill_tokens >= self._share * max(total_tokens, 1)
        )
        self._last = _Step(at, total_tokens, ids, cold) if ids else None

    @property
    def seconds_per_token(self) -> float | None:
        """The current estimate; None until a cold prefill step has been measured."""
        return self._seconds / self._tokens if self._tokens > 0 else None

    def saved(self, tokens: int) -> float:
        """Seconds of prefill that ``tokens`` loaded tokens saved (0 before any estimate)."""
        cost = self.seconds_per_token
        return tokens * cost if cost is not None and tokens > 0 else 0.0
