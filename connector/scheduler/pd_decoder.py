"""The decoder's scheduler side (``pd_role: receiver``): the PD receive buffer comes first in a
lookup, its records load outside the batch, and every claim is released exactly once.

The ``PDReceiver`` (connector/pd/) lives here, in the scheduler process, so a lookup never races
an arrival. A request's prompt is the prefiller's prompt plus its first token, so the decoder
looks up the keys of the whole chunks of the prompt minus its last token and the exact-length key
of that prefix's unfull tail (the key the prefiller sent its last chunk under). The leading keys
held on every rank load; the rest is computed.

A PD load is always one of vLLM's asynchronous loads: the lookup answers ``(n, True)``, vLLM
allocates the blocks without caching them and parks the request in ``WAITING_FOR_REMOTE_KVS``;
``after_alloc`` claims the records and plans the job at once (it goes out in the same step's
metadata); each rank copies in that step and reports the request finished with the blocks that
failed. vLLM caches the blocks only when the report comes and only those before the first failed
one (``Scheduler._update_waiting_for_remote_kv``), so a failed load's blocks never reach its
prefix cache, under either failure policy. The claim is held until the report, whatever happens
meanwhile (an abort: vLLM holds the blocks until the report too), and released once when it comes;
a request whose load was reported never loads from the buffer again. What nobody claims in time
the receiver frees on its own (its housekeeping, every second), idle engine or not.

Pure: neither vLLM nor torch (the receiver is passed in).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..engine.keys import ChunkKey
from ..engine.pd_jobs import PDChunkLoad, PDLoadJob, PDLoadResult

logger = logging.getLogger("vllm.kvlens")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pd_lookup_keys(hasher: Any, tokens: Sequence[int], prompt_len: int) -> list[ChunkKey]:
    """Keys the prefiller sent for this decoder prompt: whole chunks of the prompt minus its last
    token, then the exact-length key of its unfull tail (none when it ends a chunk)."""
    n = prompt_len - 1
    if n <= 0:
        return []
    return list(hasher.keys(tokens, True, n))


@dataclass(slots=True)
class _Found:
    keys: list[ChunkKey]
    covered: int  # tokens the leading present keys cover
    vllm_computed: int
    looked_up_at: float


@dataclass(slots=True)
class _Held:
    """A request whose load is out: from its allocation to the workers' report."""

    found: _Found
    claim: Any  # connector.pd.receive_index.Claim, None when every record was gone at allocation
    claimed_at: float
    block_ids: list[int]  # the blocks the load fills, from vLLM's own hit on
    finished: bool = False  # vLLM finished (or aborted) the request before the report


@dataclass(slots=True)
class PDOutcome:
    """The decoder's ``kvlens.pd`` for one request (the contract's fields)."""

    outcome: str = "none"  # loaded | none | failed
    reason: str | None = None
    tokens: int = 0
    bytes: int = 0
    transfer_ms: float = 0.0
    notify_wait_ms: float = 0.0
    buffer_ms: float = 0.0

    def as_params(self) -> dict[str, Any]:
        return {
            "role": "receiver",
            "outcome": self.outcome,
            "reason": self.reason,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "transfer_ms": round(self.transfer_ms, 3),
            "notify_wait_ms": round(self.notify_wait_ms, 3),
            "buffer_ms": round(self.buffer_ms, 3),
        }


MAX_OUTCOMES = 65536


class PDDecoder:
    def __init__(self, receiver: Any, block_size: int, clock: Callable[[], float]) -> None:
        self.receiver = receiver
        self._bs = block_size
        self._clock = clock
        self._found: dict[str, _Found] = {}
        self._held: dict[str, _Held] = {}
        self._jobs: list[PDLoadJob] = []  # planned at allocation, for this step's metadata
        # requests whose load was reported (they never load again), True until vLLM schedules
        # them again (that allocation is not a new lookup)
        self._after_load: dict[str, bool] = {}
        self._outcomes: dict[str, PDOutcome] = {}
        self.reported: list[tuple[str, PDOutcome]] = []  # loads reported since the last take

    # ---- lookup ---------------------------------------------------------------------------
    def lookup(self, request: Any, num_computed: int, hasher: Any) -> int:
        """Tokens beyond vLLM's own hit the receive buffer holds for this request (0: none)."""
        rid = request.request_id
        self._found.pop(rid, None)
        if hasher is None or rid in self._held or rid in self._after_load or num_computed % self._bs:
            return 0
        prompt_len = int(request.num_prompt_tokens)
        keys = pd_lookup_keys(hasher, request.all_token_ids, prompt_len)
        if not keys or keys[-1].end <= num_computed:
            return 0
        present = self.receiver.present([k.hex for k in keys])
        if present <= 0:
            return 0
        covered = keys[present - 1].end
        if covered <= num_computed:
            return 0
        self._found[rid] = _Found(keys[:present], covered, num_computed, self._clock())
        return covered - num_computed

    def holds(self, request_id: str) -> bool:
        return request_id in self._held or request_id in self._found

    def after_alloc(self, request: Any, num_external: int, block_ids: Sequence[int] | None) -> bool:
        """vLLM allocated the request's blocks and parked it until the load is reported: claim
        the records and plan the load (True: a PD load follows, its report always comes)."""
        rid = request.request_id
        found = self._found.pop(rid, None)
        if found is None or num_external <= 0:
            return False
        if found.covered - found.vllm_computed != num_external:  # vLLM took fewer: load what it took
            keep = [k for k in found.keys if k.start < found.vllm_computed + num_external]
            found.keys, found.covered = keep, found.vllm_computed + num_external
        claim = self.receiver.claim([k.hex for k in found.keys], rid)
        blocks = list(block_ids or ())
        loaded = blocks[found.vllm_computed // self._bs : cdiv(found.covered, self._bs)]
        held = self._held[rid] = _Held(found, claim, self._clock(), loaded)
        self._jobs.append(self._job(rid, held, blocks))
        if claim is None or len(claim.keys) < len(found.keys):
            logger.warning("KVLens PD: %s: records present at lookup were gone at allocation", rid[:64])
        wait_ms = max(found.looked_up_at - claim.received_at, 0.0) * 1000 if claim is not None else 0.0
        nbytes, transfer_ms = (claim.bytes, claim.transfer_ms) if claim is not None else (0, 0.0)
        self._outcomes[rid] = PDOutcome("none", None, 0, nbytes, transfer_ms, wait_ms)
        return True

    def readmitted(self, request_id: str) -> bool:
        """vLLM schedules the request after its load was reported (once True per load)."""
        if self._after_load.get(request_id):
            self._after_load[request_id] = False
            return True
        return False

    def tokens(self, request_id: str) -> int:
        """Tokens the claimed records supply beyond vLLM's own hit (for the hit-source split)."""
        held = self._held.get(request_id)
        return held.found.covered - held.found.vllm_computed if held is not None else 0

    # ---- plan -----------------------------------------------------------------------------
    def _job(self, rid: str, held: _Held, blocks: list[int]) -> PDLoadJob:
        """The load of the claimed records into ``blocks``; blocks of records the claim lost (or
        that vLLM allocated no block for) fail as they are, with every later one."""
        bs, start_block = self._bs, held.found.vllm_computed // self._bs
        claimed = len(held.claim.keys) if held.claim is not None else 0
        chunks: list[PDChunkLoad] = []
        failed: list[int] = []
        reason = None
        for i, key in enumerate(held.found.keys):
            first, end = max(key.start // bs, start_block), cdiv(key.end, bs)
            if first >= end:
                continue
            if reason is None and (i >= claimed or end > len(blocks)):
                reason = "claim_lost" if i >= claimed else "no_blocks"
            if reason is not None:
                failed += blocks[first:end]
                continue
            where = tuple((loc.buffer_name, loc.offset, loc.length) for loc in held.claim.locations[i])
            chunks.append(
                PDChunkLoad(
                    key.hex, tuple(blocks[first:end]), first - key.start // bs, key.end - first * bs, where
                )
            )
        return PDLoadJob(rid, tuple(chunks), tuple(failed), reason)

    def take_jobs(self) -> list[PDLoadJob]:
        """The loads planned since the last step (every one goes out in this step's metadata)."""
        out, self._jobs = self._jobs, []
        return out

    # ---- reports, finish, expiry ------------------------------------------------------------
    def on_results(self, results: dict[str, PDLoadResult]) -> None:
        for rid, result in results.items():
            if rid in self._held:
                self._settle(rid, result)

    def _settle(self, rid: str, result: PDLoadResult) -> None:
        held = self._held.pop(rid)
        if held.claim is not None:
            self.receiver.release(rid)
        out = self._outcomes.setdefault(rid, PDOutcome())
        received_at = held.claim.received_at if held.claim is not None else held.claimed_at
        out.buffer_ms = max(self._clock() - received_at, 0.0) * 1000
        out.tokens = self._loaded_tokens(held, result.failed_block_ids)
        if result.ok and not result.failed_block_ids:
            out.outcome = "loaded"
        else:
            out.outcome, out.reason = "failed", result.reason or "load_failed"
        self.reported.append((rid, out))
        if held.finished:
            self._outcomes.pop(rid, None)
        else:
            self._after_load[rid] = True

    def _loaded_tokens(self, held: _Held, failed: set[int]) -> int:
        """The tokens vLLM keeps: its hit is block-aligned and it truncates a load at its first
        failed block (every rank's failures merged)."""
        for i, block in enumerate(held.block_ids):
            if block in failed:
                return min(i * self._bs, held.found.covered - held.found.vllm_computed)
        return held.found.covered - held.found.vllm_computed

    def finish(self, request_id: str) -> dict[str, Any]:
        """The request ends (finished, aborted, failed): its ``kvlens.pd``. A load still out keeps
        its claim until its report (the workers may be reading the slots)."""
        self._found.pop(request_id, None)
        self._after_load.pop(request_id, None)
        held = self._held.get(request_id)
        if held is not None:
            held.finished = True
            out = self._outcomes.get(request_id)
        else:
            out = self._outcomes.pop(request_id, None)
        return (out or PDOutcome()).as_params()  # nothing received for it: "none"

    def step(self) -> None:
        """Bound what is kept per request (requests vLLM never finished cannot grow it forever)."""
        for table in (self._outcomes, self._after_load):
            if len(table) > MAX_OUTCOMES:
                for rid in list(table)[: len(table) - MAX_OUTCOMES]:
                    table.pop(rid, None)

    def take_reported(self) -> list[tuple[str, PDOutcome]]:
        out, self.reported = self.reported, []
        return out

    @property
    def held(self) -> int:
        return len(self._held)
