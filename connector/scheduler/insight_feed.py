"""Feeds the answers KVLens gives beyond hits and misses: the what-if curves of hit ratio
against tier size (and the sizing advice they imply), the engine's measured prefill cost per
token, the prefill time loads saved, and the instance's identity for ``vllm:kvlens_info``.

vLLM takes stats only from steps, and an idle engine does not step. The curves change only
with references, which come with lookups (steps), but a thread feeds them behind the step loop.
So when the engine goes idle with references still unfed or a curve not yet published, it
stays ``behind``: the facade keeps the engine stepping (empty steps), each of which feeds the
rest on the scheduler's thread for a bounded time (``catch_up``) and publishes the curve and the
advice at once. Then nothing changes until the next request, and nothing runs."""

from __future__ import annotations

import logging
import time
from typing import Any

from ..engine.keys import ChunkKey, PrefixHasher, block_prefixes
from ..engine.prefill_cost import PrefillCostMeter
from ..engine.snapshots import InsightSnapshot, WhatIfPoint
from ..engine.tracker import LookupResult
from ..engine.whatif import WhatIfTracker
from .instance_info import instance_info
from .prefix_lookup import prompt_tokens
from .scheduler_state import SchedulerState

logger = logging.getLogger("vllm.kvlens")

WHATIF_GAUGE_S = 1.0  # while busy, the what-if curves are read at most this often
CATCH_UP_S = 0.05  # an idle engine's empty step feeds the curves this long at most


class InsightFeed:
    def __init__(self, state: SchedulerState) -> None:
        self._s = state
        facts = state.facts
        capacities = {name: t.capacity_bytes for name, t in state.tiers.items()} if facts.loads else {}
        self.whatif = WhatIfTracker(capacities) if capacities else None
        if self.whatif is not None:
            self.whatif.start()
        self._whatif_points: tuple[WhatIfPoint, ...] = ()
        self._whatif_at = float("-inf")
        self._published = 0  # references fed into the curves last published
        self._advice: dict[str, str] = {}
        self.prefill_cost = PrefillCostMeter()
        self._saved_seconds: dict[str, float] = {}
        self._unpriced_tokens: dict[str, int] = {}  # loaded before the cost was known
        self._saved_announced = False  # every tier's saved series shipped once, at 0
        self.info = instance_info(state.config, facts)

    def note_references(self, request: Any, result: LookupResult) -> None:
        """A request's first schedule: feed the what-if curves and the namespace memory with
        the chunks it found, the first it missed and those it will store."""
        s = self._s
        rid = request.request_id
        policy, hasher = s.policies.get(rid), s.hashers.get(rid)
        if policy is None or hasher is None or policy.namespace is None:
            return
        stores = policy.save_skip_reason is None and s.facts.stores
        size = s.config.chunk_size
        if stores:
            fingerprint = hasher.fingerprint(request.all_token_ids)
            if fingerprint is not None and not s.first_chunks.note(fingerprint, policy.namespace):
                s.tenants.refused("namespaces_full")
        if self.whatif is None:
            return
        nbytes = s.facts.chunk_nbytes
        for hit in result.hits:
            self.whatif.record(None, hit.key.digest, nbytes(hit.key.num_tokens))
        whole = [h for h in result.hits if h.key.num_tokens == size]
        n = prompt_tokens(request)
        rest = hasher.full_keys(len(whole) * size, n)
        for key in rest if stores else rest[:1]:  # the missed chunk, then those this request stores
            self.whatif.record(None, key.digest, nbytes(size))
        tail = self._stored_tail(hasher, request.all_token_ids, n) if stores else None
        if tail is not None and all(h.key.num_tokens == size for h in result.hits):
            self.whatif.record(None, tail.digest, nbytes(tail.num_tokens))  # what a repeat finds

    def _stored_tail(self, hasher: PrefixHasher, tokens: Any, n: int) -> ChunkKey | None:
        """The unfull tail of the prompt a later identical prompt would find, if one is stored."""
        config = self._s.config
        size = config.chunk_size
        tail_start = n - n % size
        if tail_start == n:
            return None
        if config.saves_partial_chunks:
            return hasher.tail_key(tokens, n)
        if not config.extra_config.block_granular_tails or config.discard_partial_chunks:
            return None
        hasher.extend(tokens, tail_start)
        parent = hasher.parent_at(tail_start)
        for length, digest in block_prefixes(parent, tokens[tail_start:n], size, self._s.facts.block_size):
            return ChunkKey(digest, tail_start, length)  # the longest: what the request stores
        return None

    def measure_step(self, scheduler_output: Any, loaded_tokens: int) -> None:
        """Time the engine's steps to estimate what a token of prefill costs."""
        scheduled: dict[str, int] = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        prefill = 0
        cold = False
        for rid, n in scheduled.items():
            request = self._s.unfinished.get(rid)
            if request is not None:
                done = getattr(request, "num_computed_tokens", 0)
                prompt = prompt_tokens(request)
                prefill += min(n, max(prompt - done, 0))
                cold = done == 0 and n >= prompt > 0  # its whole prompt, nothing cached or loaded
        self.prefill_cost.step(
            self._s.clock(), prefill, sum(scheduled.values()), scheduled.keys(), loaded_tokens, cold
        )

    def finished(self, request_id: str) -> None:
        """A request finished (right after its last step ran): it may close a cold prefill."""
        self.prefill_cost.finished(self._s.clock(), request_id)

    def loaded(self, tokens_by_tier: dict[str, int]) -> None:
        """Tokens a load supplied: prefill time saved, at the measured cost per token (priced
        when the cost becomes known, if it is not yet: ``take_saved_seconds`` runs after every
        step's report and finished requests, so in the step that made it known)."""
        for tier, n in tokens_by_tier.items():
            self._unpriced_tokens[tier] = self._unpriced_tokens.get(tier, 0) + n

    def take_saved_seconds(self) -> dict[str, float]:
        """Estimated prefill seconds saved per tier since the last call ({} while the cost is
        unknown: "unknown", never 0 saved)."""
        cost = self.prefill_cost.seconds_per_token
        if cost is not None and not self._saved_announced:  # "0 s saved" from now on, not "unknown"
            self._saved_announced = True
            for tier in self._s.tiers:
                self._saved_seconds.setdefault(tier, 0.0)
        if cost is not None and self._unpriced_tokens:
            for tier, n in self._unpriced_tokens.items():
                self._saved_seconds[tier] = self._saved_seconds.get(tier, 0.0) + n * cost
            self._unpriced_tokens = {}
        saved, self._saved_seconds = self._saved_seconds, {}
        return saved

    def behind(self) -> bool:
        """References are not yet fed into the curves, or the curves fed are not published."""
        w = self.whatif
        return w is not None and (w.pending > 0 or w.processed != self._published)

    def catch_up(self, budget_s: float = CATCH_UP_S) -> None:
        """Feed buffered references on this thread (an idle engine's), for ``budget_s`` at most."""
        if self.whatif is None:
            return
        deadline = time.perf_counter() + budget_s
        while self.whatif.drain(256) and time.perf_counter() < deadline:
            pass

    def snapshot(self, idle: bool = False) -> InsightSnapshot:
        """The instance's identity, the what-if curves and the measured prefill cost per token.
        The curves are read at most once a second while busy, at once when ``idle``."""
        if self.whatif is not None:
            now = self._s.clock()
            if idle or now - self._whatif_at >= WHATIF_GAUGE_S:
                self._whatif_at = now
                self._published = self.whatif.processed  # read first: a later feed keeps it behind
                self._whatif_points = tuple(
                    WhatIfPoint(tier, factor, round(ratio, 4))
                    for tier, curve in self.whatif.snapshot().items()
                    for factor, ratio in curve.items()
                )
                self._log_advice()
        return InsightSnapshot(self.info, self.prefill_cost.seconds_per_token, self._whatif_points)

    def _log_advice(self) -> None:
        """One log line when a tier's sizing advice changes."""
        assert self.whatif is not None
        for tier in self._s.tiers:
            advice = self.whatif.advice(tier)
            if advice is not None and self._advice.get(tier) != advice:
                self._advice[tier] = advice
                logger.info("KVLens sizing: %s", advice)

    def shutdown(self) -> None:
        if self.whatif is not None:
            self.whatif.close()
