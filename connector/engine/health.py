"""Per-tier health: healthy -> failing -> skipped, re-probed with backoff.

A tier that errors keeps being used while failing; after ``failures_to_skip`` errors in a row
(or one timeout: a stuck tier must not be waited on again) it is skipped: no loads or stores
go to it, so a full, read-only or hung disk, or a Redis that is down, costs misses rather
than an error per chunk per step. A skipped tier is probed after a backoff that doubles up to
``max_backoff_s``; a probe or any operation that succeeds makes it healthy again. Each state
change is logged once. Thread-safe: background writers report from their own threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .outcomes import FailureReason, TierState

logger = logging.getLogger("vllm.kvlens")

# Reasons that say something about the tier itself (not about one chunk).
TIER_FAULTS = frozenset({FailureReason.IO_ERROR, FailureReason.TIMEOUT})


class TierHealth:
    def __init__(
        self,
        tier: str,
        failures_to_skip: int = 3,
        first_backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        timeout_skips: bool = True,
    ) -> None:
        self.tier = tier
        # One timeout skips the tier (a stuck tier is not waited on again), unless every wait is
        # short anyway (a lookup's existence check): then timeouts count like other errors.
        self._timeout_skips = timeout_skips
        self._failures_to_skip = failures_to_skip
        self._first_backoff = first_backoff_s
        self._max_backoff = max_backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = TierState.HEALTHY
        self._errors_in_a_row = 0
        self._backoff = first_backoff_s
        self._next_probe = 0.0
        self._probing = False
        self._changed = False

    @property
    def state(self) -> TierState:
        return self._state

    def usable(self) -> bool:
        return self._state is not TierState.SKIPPED

    def succeeded(self) -> None:
        if self._state is TierState.HEALTHY and not self._errors_in_a_row:
            return  # the common case: no lock
        with self._lock:
            self._errors_in_a_row = 0
            self._backoff = self._first_backoff
            self._set(TierState.HEALTHY, "operations succeed again")

    def failed(self, reason: FailureReason, detail: str = "") -> None:
        if reason not in TIER_FAULTS:
            return  # a missing or corrupt chunk says nothing about the tier
        with self._lock:
            self._errors_in_a_row += 1
            if self._state is TierState.SKIPPED:
                return  # an operation begun before the skip: only a success or a probe ends it
            timed_out = reason is FailureReason.TIMEOUT and self._timeout_skips
            if timed_out or self._errors_in_a_row >= self._failures_to_skip:
                self._next_probe = self._clock() + self._backoff
                self._set(TierState.SKIPPED, f"{reason.value}: {detail}")
            else:
                self._set(TierState.FAILING, f"{reason.value}: {detail}")

    def skip(self, detail: str) -> None:
        """Skipped at once, probed after the backoff: the tier cannot be reached at all (no
        connection opens), so no operation would succeed until a probe does."""
        with self._lock:
            self._errors_in_a_row += 1
            if self._state is not TierState.SKIPPED:
                self._next_probe = self._clock() + self._backoff
                self._set(TierState.SKIPPED, detail)

    def probe_due(self) -> bool:
        """True once per backoff period while skipped; the caller then runs one probe."""
        if self._state is not TierState.SKIPPED or self._probing:
            return False
        with self._lock:
            if self._probing or self._clock() < self._next_probe:
                return False
            self._probing = True
            return True

    def next_probe_in_s(self) -> float:
        """Seconds until a skipped tier's next probe may run (0: due now, or not skipped)."""
        if self._state is not TierState.SKIPPED:
            return 0.0
        return max(0.0, self._next_probe - self._clock())

    def probe_done(self, ok: bool, detail: str = "") -> None:
        with self._lock:
            self._probing = False
            if ok:
                self._errors_in_a_row = 0
                self._backoff = self._first_backoff
                self._set(TierState.HEALTHY, "probe succeeded")
            else:
                self._backoff = min(self._backoff * 2, self._max_backoff)
                self._next_probe = self._clock() + self._backoff
                logger.debug(
                    "KVLens: %s tier probe failed (%s); next in %.0f s", self.tier, detail, self._backoff
                )

    def take_change(self) -> TierState | None:
        """The state, if it changed since the last call (for the worker's report)."""
        if not self._changed:
            return None
        with self._lock:
            self._changed = False
            return self._state

    def _set(self, state: TierState, why: str) -> None:
        if state is self._state:
            return
        self._state = state
        self._changed = True
        log = logger.info if state is TierState.HEALTHY else logger.warning
        log("KVLens: %s tier is now %s (%s)", self.tier, state.value, why)
