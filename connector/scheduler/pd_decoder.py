"""The decoder's scheduler side (``pd_role: receiver``): the PD receive buffer comes first in a
lookup, its records load through the workers like any chunk, and every claim is released.

The ``PDReceiver`` (connector/pd/) lives here, in the scheduler process, so a lookup never races
an arrival. A request's prompt is the prefiller's prompt plus its first token, so the decoder
looks up the keys of the whole chunks of the prompt minus its last token and the exact-length key
of that prefix's unfull tail (the key the prefiller sent its last chunk under). The leading keys
held on every rank load; the rest is computed. A claim pins its slots from ``update_state_after_
alloc`` until the workers report the load (loaded or failed); a request aborted before its load
was planned is released at once, one aborted after only when the report comes (the workers may be
reading the slots). What nobody claims in time the receiver frees on its own (its housekeeping,
every second), idle engine or not.

Pure: neither vLLM nor torch (the receiver is passed in).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
    found: _Found
    claim: Any  # connector.pd.receive_index.Claim
    claimed_at: float
    planned: bool = False
    finished: bool = False  # vLLM finished (or aborted) the request; release on the report
    block_ids: list[int] = field(default_factory=list)


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
        self._outcomes: dict[str, PDOutcome] = {}
        self.fail_blocks: list[int] = []  # blocks vLLM allocated for records the claim lost
        self.reported: list[tuple[str, PDOutcome]] = []  # loads reported since the last take

    # ---- lookup ---------------------------------------------------------------------------
    def lookup(self, request: Any, num_computed: int, hasher: Any) -> int:
        """Tokens beyond vLLM's own hit the receive buffer holds for this request (0: none)."""
        rid = request.request_id
        self._found.pop(rid, None)
        if hasher is None or rid in self._held or num_computed % self._bs:
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
        """vLLM allocated the request's blocks: claim the records (True: a PD load follows)."""
        rid = request.request_id
        found = self._found.pop(rid, None)
        if found is None or num_external <= 0:
            return False
        claim = self.receiver.claim([k.hex for k in found.keys], rid)
        now = self._clock()
        if claim is None or len(claim.keys) < len(found.keys):
            if claim is not None:
                self.receiver.release(rid)
            blocks = list(block_ids or ())
            first = found.vllm_computed // self._bs
            self.fail_blocks += blocks[first : cdiv(found.vllm_computed + num_external, self._bs)]
            self._outcomes[rid] = PDOutcome("failed", "claim_lost")
            logger.warning("KVLens PD: %s: records present at lookup were gone at allocation", rid[:64])
            return False
        if found.covered - found.vllm_computed != num_external:  # vLLM took fewer: load what it took
            keep = [k for k in found.keys if k.start < found.vllm_computed + num_external]
            found.keys, found.covered = keep, found.vllm_computed + num_external
        self._held[rid] = _Held(found, claim, now)
        wait_ms = max(found.looked_up_at - claim.received_at, 0.0) * 1000
        self._outcomes[rid] = PDOutcome("none", None, 0, claim.bytes, claim.transfer_ms, wait_ms)
        return True

    def tokens(self, request_id: str) -> int:
        """Tokens the claimed records supply beyond vLLM's own hit (for the hit-source split)."""
        held = self._held.get(request_id)
        return held.found.covered - held.found.vllm_computed if held is not None else 0

    # ---- plan -----------------------------------------------------------------------------
    def plan(self, scheduler_output: Any) -> list[PDLoadJob]:
        """Load jobs of requests scheduled for the first time with a claim."""
        jobs = []
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()):
            held = self._held.get(new.req_id)
            if held is None or held.planned:
                continue
            held.planned = True
            blocks = list(new.block_ids[0]) if new.block_ids else []
            job = self._job(new.req_id, held, blocks)
            if job is None:
                self._fail(new.req_id, held, blocks, "no_blocks")
            else:
                jobs.append(job)
        return jobs

    def _job(self, rid: str, held: _Held, blocks: list[int]) -> PDLoadJob | None:
        bs, start_block = self._bs, held.found.vllm_computed // self._bs
        chunks = []
        for i, key in enumerate(held.found.keys):
            first, end = max(key.start // bs, start_block), cdiv(key.end, bs)
            if first >= end:
                continue
            if end > len(blocks):
                return None
            where = tuple((loc.buffer_name, loc.offset, loc.length) for loc in held.claim.locations[i])
            chunks.append(
                PDChunkLoad(
                    key.hex, tuple(blocks[first:end]), first - key.start // bs, key.end - first * bs, where
                )
            )
        held.block_ids = blocks[start_block : cdiv(held.found.covered, bs)]
        return PDLoadJob(rid, tuple(chunks))

    def _fail(self, rid: str, held: _Held, blocks: list[int], reason: str) -> None:
        bs = self._bs
        self.fail_blocks += blocks[held.found.vllm_computed // bs : cdiv(held.found.covered, bs)]
        self._settle(rid, PDLoadResult(False, reason))

    def take_fail_blocks(self) -> list[int]:
        out, self.fail_blocks = self.fail_blocks, []
        return out

    # ---- reports, finish, expiry ------------------------------------------------------------
    def on_results(self, results: dict[str, PDLoadResult]) -> None:
        for rid, result in results.items():
            if rid in self._held:
                self._settle(rid, result)

    def _settle(self, rid: str, result: PDLoadResult) -> None:
        held = self._held.pop(rid)
        self.receiver.release(rid)
        out = self._outcomes.setdefault(rid, PDOutcome())
        out.buffer_ms = max(self._clock() - held.claim.received_at, 0.0) * 1000
        if result.ok:
            out.outcome, out.tokens = "loaded", held.found.covered - held.found.vllm_computed
        else:
            out.outcome, out.reason = "failed", result.reason or "load_failed"
        self.reported.append((rid, out))
        if held.finished:
            self._outcomes.pop(rid, None)

    def finish(self, request_id: str) -> dict[str, Any]:
        """The request ends (finished, aborted): its ``kvlens.pd``; its claim released unless the
        workers may still read it (then on their report)."""
        self._found.pop(request_id, None)
        held = self._held.get(request_id)
        if held is not None and held.planned:
            held.finished = True
        elif held is not None:
            self._held.pop(request_id)
            self.receiver.release(request_id)
            self._outcomes.setdefault(request_id, PDOutcome()).reason = "aborted"
        out = self._outcomes.get(request_id) or PDOutcome()  # nothing received for it: "none"
        if held is None or not held.planned:
            self._outcomes.pop(request_id, None)
        return out.as_params()

    def step(self) -> None:
        """Bound the outcomes kept (requests vLLM never finished cannot grow it forever)."""
        if len(self._outcomes) > MAX_OUTCOMES:
            for rid in list(self._outcomes)[: len(self._outcomes) - MAX_OUTCOMES]:
                self._outcomes.pop(rid, None)

    def take_reported(self) -> list[tuple[str, PDOutcome]]:
        out, self.reported = self.reported, []
        return out

    @property
    def held(self) -> int:
        return len(self._held)
