"""Puts and deletes of a slow tier (disk, later remote) off the engine's step loop.

One background thread applies them in the order they were issued, so a delete never overtakes
the write it follows. A ``get`` of a name with a write still queued waits for that write, so a
load planned after a store always finds it. Failed writes are collected for the worker's report;
the scheduler then drops those chunks from its index.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from .base import Tier

logger = logging.getLogger("vllm.kvlens")


class BackgroundWrites:
    def __init__(self, inner: Tier, max_pending: int = 64) -> None:
        self.name = inner.name
        self._inner = inner
        self._max_pending = max_pending
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"kvlens-{inner.name}-writes")
        self._lock = threading.Lock()
        self._latest: dict[str, Future[None]] = {}  # name -> its most recent queued operation
        self._queued: deque[Future[None]] = deque()
        self._failures: list[tuple[str, str]] = []  # (name, reason)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._latest)

    def put(self, name: str, payload: memoryview) -> int:
        """Queue the write (the payload must stay unchanged until written); returns its size."""
        self._submit(name, self._write, name, payload)
        return payload.nbytes

    def delete(self, name: str) -> None:
        self._submit(name, self._delete, name)

    def get(self, name: str) -> memoryview:
        with self._lock:
            queued = self._latest.get(name)
        if queued is not None:
            queued.result()
        return self._inner.get(name)

    def clear(self) -> None:
        self.flush()
        self._inner.clear()

    def flush(self) -> None:
        """Wait until every queued operation is done."""
        while self._queued:
            self._queued.popleft().result()

    def take_failures(self) -> list[tuple[str, str]]:
        with self._lock:
            failures, self._failures = self._failures, []
        return failures

    def close(self) -> None:
        self.flush()
        self._pool.shutdown(wait=True)

    def _submit(self, name: str, op: Callable[..., None], *args: object) -> None:
        while self._queued and self._queued[0].done():
            self._queued.popleft()
        while len(self._queued) >= self._max_pending:  # back-pressure: bound the held payloads
            self._queued.popleft().result()
        future = self._pool.submit(op, *args)
        with self._lock:
            self._latest[name] = future
        future.add_done_callback(lambda f, n=name: self._forget(n, f))
        self._queued.append(future)

    def _forget(self, name: str, future: Future[None]) -> None:
        with self._lock:
            if self._latest.get(name) is future:
                del self._latest[name]

    def _write(self, name: str, payload: memoryview) -> None:
        try:
            self._inner.put(name, payload)
        except Exception as e:  # noqa: BLE001 - any failure is a failed store, never a crash
            logger.warning("KVLens: storing %s in %s failed: %s", name[:12], self.name, e)
            with self._lock:
                self._failures.append((name, f"{type(e).__name__}: {e}"))

    def _delete(self, name: str) -> None:
        try:
            self._inner.delete(name)
        except OSError as e:
            logger.warning("KVLens: evicting %s from %s failed: %s", name[:12], self.name, e)
