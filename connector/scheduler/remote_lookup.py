"""The scheduler's view of the shared remote tier: one existence round trip per request.

Other engines write to the same Redis and Redis evicts on its own, so no index here can know
what the remote holds. A lookup asks once, for every chunk of the prompt that the local tiers
do not hold (every rank's share, pipelined, grouped per cluster node), within
``remote_lookup_timeout_ms``; after that the remote counts as a miss for that request. vLLM
asks again while a request waits to be scheduled: the answer is reused for ``REUSE_S``.
A chunk that was there at lookup and is gone at load is a failed block vLLM recomputes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from ..engine.health import TierHealth
from ..engine.keys import storage_name
from ..engine.outcomes import FailureReason, RemoteCall
from ..tiers.base import classify

logger = logging.getLogger("vllm.kvlens")

REUSE_S = 1.0


class RemoteLookup:
    def __init__(self, tier: object, world_size: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._tier = tier  # RedisTier (duck-typed: exists_many, ping, close)
        self._world = world_size
        self._clock = clock
        # A lookup waits at most remote_lookup_timeout_ms (tens of ms): a busy Redis that misses
        # it once costs that request its remote hits, not the whole tier for seconds.
        self.health = TierHealth("remote", clock=clock, timeout_skips=False)
        self._answers: dict[str, tuple[float, tuple[str, ...], list[bool]]] = {}

    def present(self, request_id: str, names: Sequence[str]) -> tuple[list[bool], RemoteCall | None]:
        """Which chunks (digests) the remote holds for every rank; at most one round trip."""
        if not names:
            return [], None
        now = self._clock()
        cached = self._answers.get(request_id)
        if cached is not None and now - cached[0] < REUSE_S and cached[1] == tuple(names):
            return cached[2], None
        if not self.usable():
            return [False] * len(names), None
        keys = [storage_name(n, r) for n in names for r in range(self._world)]
        start = time.time_ns()
        try:
            found = self._tier.exists_many(keys)  # type: ignore[attr-defined]
        except OSError as e:
            reason, detail = classify(e)
            self.health.failed(reason if reason is FailureReason.TIMEOUT else FailureReason.IO_ERROR, detail)
            call = RemoteCall("exists", start, time.time_ns(), len(keys), error=getattr(e, "kind", "error"))
            return [False] * len(names), call
        self.health.succeeded()
        w = self._world
        answer = [all(found[i * w : (i + 1) * w]) for i in range(len(names))]
        self._answers[request_id] = (now, tuple(names), answer)
        return answer, RemoteCall("exists", start, time.time_ns(), len(keys))

    def usable(self) -> bool:
        """Healthy or failing; when skipped, one bounded ping per backoff period may revive it."""
        return self.health.usable() or self._probe()

    def _probe(self) -> bool:
        if not self.health.probe_due():
            return False
        try:
            self._tier.ping()  # type: ignore[attr-defined]
        except OSError as e:
            self.health.probe_done(False, str(e))
            return False
        self.health.probe_done(True)
        return True

    def forget(self, request_id: str) -> None:
        self._answers.pop(request_id, None)

    def close(self) -> None:
        try:
            self._tier.close()  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - shutting down
            logger.debug("KVLens: closing the remote lookup client: %s", e)
