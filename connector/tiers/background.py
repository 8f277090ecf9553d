"""A slow tier (disk, remote) used from the engine's step loop without ever blocking it.

Writes and deletes run on one daemon thread in the order they were issued, so a delete never
overtakes the write it follows. Queued payloads are bounded in bytes: a write that does not
fit is refused at once (``QueueFull``), never waited for. Reads run on a small pool of daemon
threads and are waited for at most ``timeout_s``; a read of a name whose write is still queued
first waits for that write, within the same bound. A tier that stops answering therefore
costs failed blocks and a health state change, never a hung engine. Threads are daemons and
``close`` waits a bounded time, so a hung disk cannot hang the process's exit either.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple

from ..cpu_affinity import run_beside_worker
from ..engine.health import TierHealth
from ..engine.outcomes import FailureReason, RemoteCall, Stage, TierTraffic
from .base import Tier, TierSkipped, classify
from .disk import DiskTier
from .disk_layers import LayeredReads, Targets

logger = logging.getLogger("vllm.kvlens")


MAX_BATCH = 16  # writes sent in one pipelined call
MAX_BATCH_BYTES = 64 * 1024**2


class Written(NamedTuple):
    """A write that landed: what the caller said it holds, its size and its share of the time."""

    tokens: int
    nbytes: int
    seconds: float


class QueueFull(Exception):
    """The tier's write queue holds its limit in bytes; the store is dropped."""


class _Op:
    __slots__ = ("kind", "name", "payload", "namespace", "tokens", "done", "started")

    def __init__(
        self, kind: str, name: str, payload: memoryview | None = None, namespace: str = "", tokens: int = 0
    ) -> None:
        self.kind, self.name, self.payload = kind, name, payload
        self.namespace, self.tokens = namespace, tokens
        self.done = threading.Event()
        self.started = 0.0


class BackgroundTier:
    def __init__(
        self,
        inner: Tier,
        health: TierHealth,
        timeout_s: float = 5.0,
        max_pending_bytes: int = 512 * 1024**2,
        readers: int = 2,
        lower_readers: bool = True,
    ) -> None:
        """``lower_readers``: the reader threads run below the forward pass's priority
        (``cpu_affinity``); False keeps the caller's, only for measuring what that costs."""
        self.name = inner.name
        self.inner = inner
        self.health = health
        self.timeout_s = timeout_s
        self._max_pending_bytes = max_pending_bytes
        self._lower_readers = lower_readers
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ops: deque[_Op] = deque()
        self._current: _Op | None = None
        self._latest_write: dict[str, _Op] = {}
        self._pending_bytes = 0
        self._failures: list[tuple[str, FailureReason, str]] = []
        self._kept: list[tuple[str, int]] = []  # deletes the tier declined: (name, bytes kept)
        self._deleted: list[str] = []  # deletes that removed a file (not one another engine removed)
        self._written: list[Written] = []  # writes that landed, not yet taken
        self._read_spans: list[tuple[float, float, int]] = []  # (start, end, bytes) of good reads
        self._closed = False
        # A tier that batches (put_many / get_many: one pipelined round trip per node) gets
        # consecutive writes and a load's reads in one call each; its calls are logged.
        self._batched = hasattr(inner, "put_many") and hasattr(inner, "get_many")
        self.calls: deque[RemoteCall] | None = deque(maxlen=4096) if self._batched else None
        self.reads: deque[RemoteCall] = deque(maxlen=4096)
        self._writer = threading.Thread(
            target=self._write_loop, name=f"kvlens-{self.name}-writer", daemon=True
        )
        self._writer.start()
        self._reads: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._readers = [
            threading.Thread(target=self._read_loop, name=f"kvlens-{self.name}-reader", daemon=True)
            for _ in range(readers)
        ]
        for t in self._readers:
            t.start()

    # ---- writes -------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._ops) + (self._current is not None)

    def put(self, name: str, payload: memoryview, namespace: str = "", tokens: int = 0) -> int:
        """Queue the write (the payload must stay unchanged until written); its size.
        ``tokens`` comes back with the write once it landed (``take_traffic``)."""
        with self._lock:
            if self._closed or self._pending_bytes + payload.nbytes > self._max_pending_bytes:
                raise QueueFull(f"{self._pending_bytes} bytes queued for {self.name}")
            op = _Op("put", name, payload, namespace, tokens)
            self._pending_bytes += payload.nbytes
            self._latest_write[name] = op
            self._ops.append(op)
            self._wake.notify()
        return payload.nbytes

    def delete(self, name: str) -> None:
        with self._lock:
            self._ops.append(_Op("delete", name))
            self._wake.notify()

    def take_failures(self) -> list[tuple[str, FailureReason, str]]:
        with self._lock:
            failures, self._failures = self._failures, []
        return failures

    def take_kept(self) -> list[tuple[str, int]]:
        with self._lock:
            kept, self._kept = self._kept, []
        return kept

    def take_deleted(self) -> list[str]:
        with self._lock:
            deleted, self._deleted = self._deleted, []
        return deleted

    def take_traffic(self, counts_chunks: int = 1) -> TierTraffic:
        """Writes that landed (the tier holds them now) and reads that succeeded since the last
        call. Chunks and tokens count ``counts_chunks`` times (0 on ranks but the first)."""
        with self._lock:
            written, self._written = self._written, []
            spans, self._read_spans = self._read_spans, []
        traffic = TierTraffic()
        for w in written:
            traffic.add_stored(counts_chunks, w.tokens * counts_chunks, w.nbytes)
            traffic.add_moved(Stage.WRITE, w.nbytes, w.seconds)
        if spans:  # reads overlap on the reader threads: their union is the time spent
            busy, reach = 0.0, float("-inf")
            for start, end, _ in sorted(spans):
                if end > reach:
                    busy += end - max(start, reach)
                    reach = end
            traffic.add_moved(Stage.READ, sum(n for _, _, n in spans), busy)
        return traffic

    def stuck(self) -> bool:
        """True when the operation in flight has run longer than the timeout."""
        op = self._current
        return op is not None and op.started and time.monotonic() - op.started > self.timeout_s

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued operation is done; False if that took longer than allowed."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._ops or self._current is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(min(left, 0.05))
        return True

    def _write_loop(self) -> None:
        # Normal priority: a store is looked up by the next request as soon as it lands (a
        # writer yielding to every busy thread made a prompt asked again at once miss Redis).
        run_beside_worker()
        while True:
            with self._lock:
                while not self._ops and not self._closed:
                    self._wake.wait()
                if not self._ops:
                    return
                batch = [self._ops.popleft()]
                if batch[0].kind == "put" and self._batched:  # consecutive puts: one pipeline
                    size = batch[0].payload.nbytes if batch[0].payload is not None else 0
                    while self._ops and self._ops[0].kind == "put" and len(batch) < MAX_BATCH:
                        size += self._ops[0].payload.nbytes if self._ops[0].payload is not None else 0
                        if size > MAX_BATCH_BYTES:
                            break
                        batch.append(self._ops.popleft())
                self._current = batch[0]
                started = time.monotonic()
                for op in batch:
                    op.started = started
            try:
                self._apply(batch)
            finally:
                with self._lock:
                    self._current = None
                    for op in batch:
                        if op.kind == "put":
                            self._pending_bytes -= op.payload.nbytes if op.payload is not None else 0
                            op.payload = None
                            if self._latest_write.get(op.name) is op:
                                del self._latest_write[op.name]
                        op.done.set()
                    self._wake.notify_all()

    def _apply(self, batch: list[_Op]) -> None:
        began = time.perf_counter()
        start = time.time_ns()
        nbytes = sum(op.payload.nbytes for op in batch if op.payload is not None)
        kind = batch[0].kind
        try:
            if kind == "put" and not self.health.usable():  # queued before the tier was skipped
                errors = [TierSkipped(f"{self.name} tier is skipped")] * len(batch)
            elif len(batch) > 1:
                errors = self.inner.put_many(  # type: ignore[attr-defined]
                    [(op.name, op.payload) for op in batch], [op.namespace for op in batch]
                )
            elif kind == "put":
                op = batch[0]
                assert op.payload is not None
                if op.namespace:  # tiers without records (and test fakes) take two arguments
                    self.inner.put(op.name, op.payload, op.namespace)
                else:
                    self.inner.put(op.name, op.payload)
                errors = [None]
            else:
                errors = [None]
                deleted = self.inner.delete(batch[0].name)
                if deleted is False:
                    size = getattr(self.inner, "stored_size", lambda _n: 0)(batch[0].name)
                    with self._lock:
                        self._kept.append((batch[0].name, size))
                elif deleted is True:
                    with self._lock:
                        self._deleted.append(batch[0].name)
        except Exception as e:  # noqa: BLE001 - any failure is a failed store, never a crash
            errors = [e] * len(batch)
        seconds = time.perf_counter() - began
        self._log_write(kind, start, len(batch), nbytes, next((e for e in errors if e is not None), None))
        if kind == "put":
            landed = [
                Written(op.tokens, op.payload.nbytes, seconds * op.payload.nbytes / (nbytes or 1))
                for op, error in zip(batch, errors, strict=True)
                if error is None and op.payload is not None
            ]
            with self._lock:
                self._written.extend(landed)
        for op, error in zip(batch, errors, strict=True):
            if error is None:
                continue
            reason, detail = classify(error)
            self.health.failed(reason, detail)
            if op.kind == "put":
                with self._lock:
                    self._failures.append((op.name, reason, detail))
            else:
                logger.debug("KVLens: deleting %s from %s failed: %s", op.name[:12], self.name, detail)
        if any(error is None for error in errors):
            self.health.succeeded()

    def _log_write(self, kind: str, start: int, keys: int, nbytes: int, error: BaseException | None) -> None:
        if self.calls is not None:
            self.calls.append(
                RemoteCall(
                    kind,
                    start,
                    time.time_ns(),
                    keys,
                    nbytes,
                    getattr(error, "kind", "error") if error else None,
                )
            )

    # ---- reads --------------------------------------------------------------------------
    def get(self, name: str) -> memoryview:
        result = next(self.get_many([name]))
        if isinstance(result, BaseException):
            raise result
        return result

    def get_many(self, names: Sequence[str]) -> Iterator[memoryview | BaseException]:
        """Each payload (or the error reading it), in order; all reads start at once.

        The reads share one deadline of ``timeout_s`` from the call; one that misses it
        yields a ``TimeoutError``. A tier that reads in batches (one pipelined round trip
        per node) is asked once for all of them, a single name too, so that every round trip
        is logged.
        """
        deadline = time.monotonic() + self.timeout_s
        if self._batched and names:
            batch = self._submit(lambda: self._read_batch(list(names)))
            try:
                results = batch.result(timeout=self.timeout_s)
            except TimeoutError:
                results = [TimeoutError(f"{self.name} read took over {self.timeout_s:g} s")] * len(names)
            except Exception as e:  # noqa: BLE001 - handed to the caller as values
                results = [e] * len(names)
            yield from results
            return
        futures = [self._submit_read(name) for name in names]
        for future in futures:
            try:
                yield future.result(timeout=max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                yield TimeoutError(f"{self.name} read took over {self.timeout_s:g} s")
            except Exception as e:  # noqa: BLE001 - handed to the caller as a value
                yield e

    def _read_batch(self, names: list[str]) -> list[memoryview | BaseException]:
        with self._lock:
            writes = [self._latest_write.get(n) for n in names]
        for write in writes:
            if write is not None:
                write.done.wait()
        began = time.perf_counter()
        start = time.time_ns()
        results = self.inner.get_many(names)  # type: ignore[attr-defined]
        nbytes = sum(r.nbytes for r in results if isinstance(r, memoryview))
        if nbytes:
            self._note_read(began, nbytes)
        error = next((r for r in results if isinstance(r, OSError)), None)
        if self.calls is not None:
            self.reads.append(
                RemoteCall(
                    "get",
                    start,
                    time.time_ns(),
                    len(names),
                    nbytes,
                    getattr(error, "kind", "error") if error else None,
                )
            )
        return results

    @property
    def layered(self) -> bool:
        """Whether its records can be read a layer at a time (``get_layered``)."""
        return isinstance(self.inner, DiskTier)

    def get_layered(
        self, names: Sequence[str], num_layers: int, targets: Sequence[Targets | None] = ()
    ) -> LayeredReads:
        """Start reading the records of ``names`` every record's layer 0 first, then layer 1...
        (``disk_layers.py``), straight into ``targets`` where given; waits on the result are
        bounded by ``timeout_s`` from now."""
        assert isinstance(self.inner, DiskTier)
        with self._lock:
            writes = [w.done for w in (self._latest_write.get(n) for n in names) if w is not None]
        reads = LayeredReads(self.inner, names, num_layers, self.timeout_s, writes, self._note_span, targets)
        self._submit(reads.open_all)
        for layer in range(num_layers):
            self._submit(lambda layer=layer: reads.read_layer(layer))
        return reads

    def _note_span(self, began: float, ended: float, nbytes: int) -> None:
        with self._lock:
            self._read_spans.append((began, ended, nbytes))

    def _submit_read(self, name: str) -> Future[memoryview]:
        with self._lock:
            write = self._latest_write.get(name)

        def read() -> memoryview:
            if write is not None:
                write.done.wait()
            began = time.perf_counter()
            payload = self.inner.get(name)
            self._note_read(began, payload.nbytes)
            return payload

        return self._submit(read)

    def _note_read(self, began: float, nbytes: int) -> None:
        with self._lock:
            self._read_spans.append((began, time.perf_counter(), nbytes))

    def run(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run ``fn`` on a reader thread (probes): the caller decides how long to wait."""
        return self._submit(fn)

    def _submit(self, fn: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self._reads.put((future, fn))
        return future

    def _read_loop(self) -> None:
        run_beside_worker(background=self._lower_readers)
        while True:
            item = self._reads.get()
            if item is None:
                return
            future, fn = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - delivered to the waiting caller
                future.set_exception(e)
            # Idle, this thread must not keep the last read alive: its payloads' buffers are
            # reused once nothing holds them (read_buffers.py).
            item = future = fn = None  # type: ignore[assignment]

    # ---- lifecycle ----------------------------------------------------------------------
    def clear(self) -> None:
        self.run(self.inner.clear)

    def close(self, timeout_s: float = 5.0) -> bool:
        """Finish queued writes within ``timeout_s`` (dropping the rest) and stop the threads."""
        drained = self.drain(timeout_s)
        with self._lock:
            self._closed = True
            dropped = len(self._ops)
            self._ops.clear()
            self._wake.notify_all()
        if dropped:
            logger.warning("KVLens: %d queued %s writes dropped at shutdown", dropped, self.name)
        for _ in self._readers:
            self._reads.put(None)
        left = max(timeout_s, 0.1)
        for t in (self._writer, *self._readers):
            t.join(timeout=left if t is self._writer else 0.1)
        return drained
