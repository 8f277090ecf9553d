"""The scheduler's view of the shared remote tier: one existence round trip per request.

Other engines write to the same Redis and Redis evicts on its own, so no index here can know
what the remote holds. A lookup asks once, for every chunk of the prompt that the local tiers
do not hold (every rank's share, pipelined, grouped per cluster node). The round trip runs on
a thread of its own; vLLM's scheduler waits for it at most ``remote_lookup_timeout_ms``, so a
slow Redis never holds up a step. An answer that takes longer is still awaited: the lookup says
"ask again" (vLLM leaves the request waiting and asks at its next step) until it comes, within
the remote's data-call timeout (``remote_timeout_s``); only then does the remote count as a miss
for that request, reported as ``lookup_timeout``. A request never misses its remote hits because
a loaded host answered in 60 ms instead of 50. An answer is reused for ``REUSE_S``. A chunk that
was there at lookup and is gone at load is a failed block vLLM recomputes.

A lookup never opens a connection: opening one (connect, authenticate, select, find the master
or the slot map) costs round trips a lookup's tens of milliseconds cannot pay on a loaded host.
The client connects at start-up, and a keeper thread re-opens what is lost (after a timeout
redis-py drops the connection; a restarted server closes it) and probes a skipped tier. A lookup
that finds no open connection asks nothing and wakes the keeper.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from ..engine.health import TierHealth
from ..engine.keys import storage_name
from ..engine.outcomes import FailureReason, MissReason, RemoteCall
from ..tiers.base import classify

logger = logging.getLogger("vllm.kvlens")

REUSE_S = 1.0
KEEPALIVE_S = 1.0  # a PING on the lookup connections after lookups left them idle this long
START_UP_S = 2.0  # how long start-up tries to connect a Redis that answers, slowly (remote_timeout_s)
RETRY_PAUSE_S = 0.05


@dataclass(frozen=True, slots=True)
class RemoteAnswer:
    """What the remote said of a lookup's chunks."""

    present: list[bool] = field(default_factory=list)  # per chunk: held for every rank
    call: RemoteCall | None = None  # the round trip, if one was made
    # why the remote could not say (lookup_timeout, tier_unhealthy); None: it answered
    unanswered: MissReason | None = None
    pending: bool = False  # asked, not answered yet: ask again (vLLM's "not yet" for the request)


@dataclass(frozen=True, slots=True)
class _Asked:
    """A round trip still running for a request: what it asks and since when."""

    names: tuple[str, ...]
    answer: Future
    since: float


class RemoteLookup:
    def __init__(
        self,
        tier: object,
        world_size: int,
        clock: Callable[[], float] = time.monotonic,
        budget_s: float = 0.05,
        keepalive_s: float | None = KEEPALIVE_S,
        start_up_s: float = START_UP_S,
        wait_s: float = START_UP_S,
    ) -> None:
        """``budget_s``: how long a lookup call waits for the round trip (remote_lookup_timeout_ms);
        ``wait_s``: how long a request keeps waiting for it over further calls (remote_timeout_s),
        after which it is a ``lookup_timeout``."""
        self._tier = tier  # RedisTier (duck-typed: exists_many, connect, warm, ping, close)
        self._world = world_size
        self._clock = clock
        self._budget_s = budget_s
        # A lookup waits at most remote_lookup_timeout_ms (tens of ms): a busy Redis that misses
        # it once costs that request its remote hits, not the whole tier for seconds.
        self.health = TierHealth("remote", clock=clock, timeout_skips=False)
        self._wait_s = max(wait_s, budget_s)
        self._answers: dict[str, tuple[float, tuple[str, ...], list[bool]]] = {}
        self._asked: dict[str, _Asked] = {}  # round trips that outlasted their call's budget
        self._asker = ThreadPoolExecutor(1, thread_name_prefix="kvlens-remote-lookup-ask")
        self._using = threading.Lock()  # a lookup and the keeper's PING never share a connection
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._timed_out = False  # the last round trip timed out: its connection is being re-opened
        self._used_at = clock()
        self._keepalive_s = KEEPALIVE_S if keepalive_s is None else keepalive_s
        self._last_error: tuple[FailureReason, str] = (FailureReason.IO_ERROR, "")
        if not self._open_at_start_up(start_up_s):
            reason, detail = self._last_error
            self.health.skip(f"not reachable at start-up ({detail}); connecting in the background")
        self._keeper: threading.Thread | None = None
        if keepalive_s is not None:
            self._keeper = threading.Thread(target=self._keep, name="kvlens-remote-lookup", daemon=True)
            self._keeper.start()

    def present(self, request_id: str, names: Sequence[str]) -> RemoteAnswer:
        """Which chunks (digests) the remote holds for every rank; at most one round trip."""
        if not names:
            return RemoteAnswer()
        now = self._clock()
        asked = self._asked.get(request_id)
        if asked is not None and asked.names == tuple(names):
            return self._await(request_id, asked, now, wait_s=0.0)
        cached = self._answers.get(request_id)
        if cached is not None and now - cached[0] < REUSE_S and cached[1] == tuple(names):
            return RemoteAnswer(cached[2])
        if not self.health.usable():
            return RemoteAnswer([False] * len(names), unanswered=MissReason.TIER_UNHEALTHY)
        # Whether a connection is open is seen by the asking thread, once the round trip before
        # this one (or the keeper's PING) has handed it back.
        asked = _Asked(tuple(names), self._asker.submit(self._ask_when_free, request_id, names, now), now)
        return self._await(request_id, asked, now, wait_s=self._budget_s)

    def _await(self, request_id: str, asked: _Asked, now: float, wait_s: float) -> RemoteAnswer:
        """The round trip's answer if it comes within ``wait_s``; else "ask again" while the
        request may still wait for it, then ``lookup_timeout`` (the answer, when it comes, is
        dropped: the request has been told)."""
        try:
            answer = asked.answer.result(timeout=wait_s)  # 0: only if it has come already
        except FutureTimeout:
            answer = None
        if answer is not None:
            self._asked.pop(request_id, None)
            return answer
        if self._clock() - asked.since < self._wait_s:
            self._asked[request_id] = asked
            return RemoteAnswer([False] * len(asked.names), pending=True)
        self._asked.pop(request_id, None)
        return RemoteAnswer([False] * len(asked.names), unanswered=MissReason.LOOKUP_TIMEOUT)

    def _ask_when_free(self, request_id: str, names: Sequence[str], now: float) -> RemoteAnswer:
        """On the asking thread: the round trip, once the keeper's PING has left the connection."""
        with self._using:
            try:
                if not self.connected():  # lost while queued: the keeper re-opens it
                    self._wake.set()
                    return RemoteAnswer([False] * len(names), unanswered=self._not_connected())
                return self._ask(request_id, names, now)
            finally:
                self._used_at = self._clock()

    def _ask(self, request_id: str, names: Sequence[str], now: float) -> RemoteAnswer:
        keys = [storage_name(n, r) for n in names for r in range(self._world)]
        missed = [False] * len(names)
        start = time.time_ns()
        try:
            found = self._tier.exists_many(keys)  # type: ignore[attr-defined]
        except OSError as e:
            reason, detail = classify(e)
            timed_out = reason is FailureReason.TIMEOUT
            if getattr(e, "kind", None) == "connection":  # refused, reset: no lookup would succeed
                self.health.skip(f"connection lost ({detail}); reconnecting in the background")
            else:
                self.health.failed(FailureReason.TIMEOUT if timed_out else FailureReason.IO_ERROR, detail)
            self._timed_out = timed_out
            self._wake.set()  # redis-py dropped the connection: the keeper re-opens it
            call = RemoteCall("exists", start, time.time_ns(), len(keys), error=getattr(e, "kind", "error"))
            why = MissReason.LOOKUP_TIMEOUT if timed_out else MissReason.TIER_UNHEALTHY
            return RemoteAnswer(missed, call, why)
        self.health.succeeded()
        self._timed_out = False
        w = self._world
        answer = [all(found[i * w : (i + 1) * w]) for i in range(len(names))]
        self._answers[request_id] = (now, tuple(names), answer)
        return RemoteAnswer(answer, RemoteCall("exists", start, time.time_ns(), len(keys)))

    def _not_connected(self) -> MissReason:
        """Why a lookup that found no open connection (or the keeper's PING on it) asked nothing:
        its connection is being re-opened after a timeout, or the tier failed."""
        return MissReason.LOOKUP_TIMEOUT if self._timed_out else MissReason.TIER_UNHEALTHY

    def usable(self) -> bool:
        """Not skipped: lookups ask it when it has an open connection."""
        return self.health.usable()

    def connected(self) -> bool:
        """A lookup now finds an open connection to every node (so opens none itself)."""
        warm = getattr(self._tier, "warm", None)
        return warm is None or bool(warm())

    # ---- the keeper: connections opened outside any request's budget --------------------
    def _open(self) -> bool:
        """Open the connections lookups use (at start-up and on the keeper's thread only)."""
        try:
            self._tier.connect()  # type: ignore[attr-defined]
        except OSError as e:
            reason, detail = classify(e)
            self._last_error = (reason, detail)
            logger.debug("KVLens: remote lookup client could not connect: %s", detail)
            return False
        self._timed_out = False
        return True

    def _open_at_start_up(self, within_s: float) -> bool:
        """Connect before the first request. The client's timeouts are a lookup's (tens of ms),
        which a host busy starting engines may miss for a while: a timeout is tried again until
        ``within_s`` has passed. A refused connection is not (Redis is down: the keeper connects
        once it is up)."""
        deadline = time.monotonic() + within_s
        while not self._open():
            if self._last_error[0] is not FailureReason.TIMEOUT or time.monotonic() >= deadline:
                return False
            time.sleep(RETRY_PAUSE_S)
        return True

    def tend(self) -> None:
        """One pass of the keeper: probe a skipped tier when due; re-open lost connections; PING
        connections lookups left idle for a while (a dead one is found here, not in a lookup)."""
        if not self.health.usable():
            if self.health.probe_due():
                self.health.probe_done(self._open(), "could not connect")
            return
        if self.connected() and self._clock() - self._used_at < self._keepalive_s:
            return
        with self._using:
            if self._open():
                self._used_at = self._clock()
                return
        reason, detail = self._last_error
        if reason is FailureReason.TIMEOUT:
            self.health.failed(reason, detail)  # slow to answer: counted, skipped after a few
        else:
            self.health.skip(f"connection lost ({detail}); reconnecting in the background")

    def _keep(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(self._keepalive_s)
            self._wake.clear()
            if self._closed.is_set():
                return
            try:
                self.tend()
            except Exception:  # noqa: BLE001 - the keeper must outlive any one failure
                logger.exception("KVLens: the remote lookup client's keeper failed; it goes on")

    def forget(self, request_id: str) -> None:
        self._answers.pop(request_id, None)
        self._asked.pop(request_id, None)  # its round trip, if still running, ends unread

    def waiting(self) -> int:
        """Requests whose round trip outlasted their call's budget and is still awaited."""
        return len(self._asked)

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        self._asker.shutdown(wait=False, cancel_futures=True)
        self._asked.clear()
        if self._keeper is not None:
            self._keeper.join(timeout=1.0)
        try:
            self._tier.close()  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - shutting down
            logger.debug("KVLens: closing the remote lookup client: %s", e)
