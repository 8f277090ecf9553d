"""A worker rank's PD work: the prefiller's gathers handed to its ``PDSender``, the decoder's loads
from the receive buffer.

Sends: after the step's forward pass each job's chunks are gathered from the KV cache into host
buffers (this rank's share, the bytes the CPU tier would hold) and handed to the sender, which
sends them on its own thread: the batch never waits on the network. The buffers stay referenced
until the sender's ``on_done``; then, on a third thread, the proxy is notified (success or
failure, once per transfer and rank) and the outcome waits for the next report. A chunk over a
block whose load failed on this rank is never sent (refused; the decoder recomputes). The slots of
a prompt's last block past the prompt hold what the block's previous occupant left: they are
zeroed before the send (``TailSlots``), or, where this rank cannot tell them apart, that unfull
last chunk is not sent (the decoder computes it).

Loads: vLLM's asynchronous loads (the request waits outside the batch). In the step whose
metadata carries a job (``start_load_kv``, after that step's forward pass), each claimed record is
read from the rank's receive buffer (attached read-only, once per buffer) and scattered into the
request's blocks; any failure fails that chunk's blocks and every later one (vLLM recomputes them).
Every job is reported in the same step, whatever happened: the request in ``finished_recving``,
its failed blocks with the step's, its outcome to the scheduler, which releases the claim.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..engine.pd_jobs import PDLoadJob, PDLoadResult, PDSendJob, PDSendReport

if TYPE_CHECKING:
    from .tail_slots import TailSlots

logger = logging.getLogger("vllm.kvlens")


class PDSends:
    """One rank's sends. ``make_sender(key_space)`` builds the rank's PDSender (lazily: the key
    space comes with the first job); ``notifier`` is the rank's ProxyNotifier or None."""

    def __init__(
        self,
        rank: int,
        make_sender: Callable[[str], Any],
        make_transfer: Callable[..., Any],
        notifier: Any,
        max_pending_bytes: int,
    ) -> None:
        self.rank = rank
        self._make_sender, self._make_transfer = make_sender, make_transfer
        self._sender: Any = None
        self._notifier = notifier
        self._max_pending = max_pending_bytes
        # which bytes of a gathered block are which token's (set once the KV is registered;
        # None: gathers go out as they are, for fakes whose bytes are no KV)
        self.tails: TailSlots | None = None
        self._lock = threading.Lock()
        self._holding: dict[str, tuple[list[Any], int]] = {}  # request -> (buffers, bytes)
        self._reports: list[PDSendReport] = []
        self.pending_bytes = 0
        # Ends to report, the proxy's notice first, on a thread of their own: a notice may wait
        # (bounded) for an absent proxy, and neither the batch nor the sender waits for it.
        self._ends: queue.SimpleQueue[tuple[PDSendJob, PDSendReport] | None] = queue.SimpleQueue()
        self._unreported = 0
        self._reporter = threading.Thread(
            target=self._report_ends, name=f"kvlens-pd-notify-{rank}", daemon=True
        )
        self._reporter.start()

    def run(
        self, jobs: list[PDSendJob], gather: Callable[[tuple[int, ...]], Any], failed_blocks: set[int]
    ) -> None:
        """Gather each job's chunks (``gather(block_ids)`` -> host tensor) and hand them over."""
        for job in jobs:
            if job.refused is not None:
                self._ended(job, False, job.refused, 0, 0.0, "")
                continue
            if any(b in failed_blocks for c in job.chunks for b in c.block_ids):
                self._ended(job, False, "load_failed", 0, 0.0, "")
                continue
            size = 0
            buffers, chunks = [], []
            try:
                for chunk in job.chunks:
                    data = gather(chunk.block_ids)
                    if self.tails is not None and not self.tails.clear(data, chunk.num_tokens):
                        logger.debug("KVLens PD: %s: unfull last chunk not sent", job.request_id[:64])
                        break  # the last chunk; the decoder loads the ones before it
                    view = memoryview(data.numpy()).cast("B")
                    buffers.append(data)
                    chunks.append((chunk.key, view, chunk.num_tokens))
                    size += view.nbytes
            except (RuntimeError, ValueError) as e:
                logger.warning("KVLens PD: gathering %s failed: %s", job.request_id[:64], e)
                self._ended(job, False, "gather_failed", 0, 0.0, "")
                continue
            with self._lock:
                if self.pending_bytes + size > self._max_pending:
                    over = True
                else:
                    over = False
                    self.pending_bytes += size
                    self._holding[job.request_id] = (buffers, size)
            if over:  # the senders are behind by a whole buffer: refuse rather than grow memory
                self._ended(job, False, "send_backlog", 0, 0.0, "")
                continue
            if self._sender is None:
                self._sender = self._make_sender(job.key_space)
            transfer = self._make_transfer(
                req_id=job.req_id,
                request_id=job.request_id,
                host=job.host,
                init_port=job.init_ports[self.rank],
                alloc_port=job.alloc_ports[self.rank],
                chunks=chunks,
                on_done=lambda outcome, job=job: self._done(job, outcome),
            )
            self._sender.send(transfer)

    def _done(self, job: PDSendJob, outcome: Any) -> None:
        """On the sender's thread: the buffers may go; the proxy hears; the outcome is reported."""
        with self._lock:
            held = self._holding.pop(job.request_id, None)
            if held is not None:
                self.pending_bytes -= held[1]
        self._ended(job, outcome.ok, outcome.reason, outcome.bytes, outcome.seconds, outcome.peer)

    def _ended(
        self, job: PDSendJob, ok: bool, reason: str | None, nbytes: int, seconds: float, peer: str
    ) -> None:
        report = PDSendReport(job.request_id, job.req_id, self.rank, ok, reason, nbytes, seconds, peer, None)
        with self._lock:
            self._unreported += 1
        self._ends.put((job, report))

    def _report_ends(self) -> None:
        while (item := self._ends.get()) is not None:
            job, report = item
            if job.notify and self._notifier is not None:
                try:
                    notified = bool(self._notifier.notify(job.req_id))
                except Exception as e:  # a notice must never take the worker down
                    logger.warning("KVLens PD: notifying the proxy of %s failed: %s", job.req_id[:64], e)
                    notified = False
                report = dataclasses.replace(report, notified=notified)
            with self._lock:
                self._reports.append(report)
                self._unreported -= 1

    def wait_reported(self, timeout_s: float) -> bool:
        """Whether every end so far is reported within ``timeout_s`` (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if self._unreported == 0:
                    return True
            time.sleep(0.002)
        return False

    def take_reports(self) -> list[PDSendReport]:
        with self._lock:
            out, self._reports = self._reports, []
        return out

    @property
    def holding(self) -> int:
        with self._lock:
            return len(self._holding)

    def close(self, timeout_s: float) -> None:
        if self._sender is not None:
            self._sender.close(timeout_s)  # what is under way ends as shutdown: its proxy still hears
        self.wait_reported(timeout_s)
        self._ends.put(None)
        self._reporter.join(timeout_s)
        if self._notifier is not None:
            self._notifier.close()


class PDLoads:
    """One rank's loads from the decoder's receive buffer (``attach(name)`` maps a buffer)."""

    def __init__(self, rank: int, attach: Callable[[str], Any]) -> None:
        self.rank = rank
        self._attach = attach
        self._attached: dict[str, Any] = {}
        self._results: dict[str, PDLoadResult] = {}
        self._finished: set[str] = set()

    def run(self, jobs: list[PDLoadJob], copier: Any) -> set[int]:
        """Load every job now (done when this returns); the blocks that failed. Each job ends
        reported, even one that raised (vLLM would wait for it forever)."""
        failed: set[int] = set()
        for job in jobs:
            started = time.perf_counter()
            try:
                result = self._load(job, copier)
            except Exception:  # a defect: its blocks are recomputed, the request is not left waiting
                logger.exception("KVLens PD: loading %s raised", job.request_id[:64])
                result = failed_whole(job, "internal")
            logger.debug(
                "KVLens PD: %s loaded in %.2f ms", job.request_id[:64], (time.perf_counter() - started) * 1e3
            )
            failed |= result.failed_block_ids
            self._results[job.request_id] = result
            self._finished.add(job.request_id)
        return failed

    def _load(self, job: PDLoadJob, copier: Any) -> PDLoadResult:
        if copier is None:  # no KV cache registered (never in a running engine)
            logger.warning("KVLens PD: %s not loaded: no KV cache registered", job.request_id[:64])
            return failed_whole(job, "load_failed")
        result = PDLoadResult()
        for position, chunk in enumerate(job.chunks):
            try:
                name, offset, length = chunk.where[self.rank]
                view = self._buffer(name).view(offset, length)
                payload = copier.payload_view(view)
                copier.scatter(payload, chunk.block_ids, chunk.first_block)
                result.tokens += chunk.num_tokens
                result.bytes += length
            except (OSError, ValueError, IndexError, RuntimeError) as e:
                result.ok, result.reason = False, "load_failed"
                for later in job.chunks[position:]:
                    result.failed_block_ids.update(later.block_ids)
                logger.warning(
                    "KVLens PD: loading %s from the receive buffer failed: %s", job.request_id[:64], e
                )
                break
        if job.fail_blocks:
            result.ok, result.reason = False, result.reason or job.fail_reason
            result.failed_block_ids.update(job.fail_blocks)
        return result

    def _buffer(self, name: str) -> Any:
        buffer = self._attached.get(name)
        if buffer is None:
            buffer = self._attached[name] = self._attach(name)
        return buffer

    def take_finished(self) -> set[str]:
        """Requests whose job ran since the last call: vLLM's ``finished_recving``."""
        out, self._finished = self._finished, set()
        return out

    def take_results(self) -> dict[str, PDLoadResult]:
        out, self._results = self._results, {}
        return out

    def close(self) -> None:
        for buffer in self._attached.values():
            buffer.close()
        self._attached.clear()


def failed_whole(job: PDLoadJob, reason: str) -> PDLoadResult:
    """Every block of the job failed (vLLM recomputes them)."""
    blocks = {b for c in job.chunks for b in c.block_ids} | set(job.fail_blocks)
    return PDLoadResult(False, reason, blocks)
