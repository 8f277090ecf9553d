"""The scheduler's half of blending (``enable_blending``): which prompts blend, what each loads and
stores, and what the workers report.

A prompt blends when it holds the separator and at least one segment long enough to reuse
(``blend_min_tokens``), and KVLens's prefix chunks do not already cover it. Its reusable segments'
chunks (``segment_keys``) are looked up in the CPU and disk indexes (pinned until the workers
report) and, where a remote tier is configured, tried there by the workers; the connector then
reports the whole prompt but its last token to vLLM, which schedules only the last token. The
request's own prefix chunks are neither loaded (the blend supersedes them) nor stored (blended
KV is not a prefix's exact KV). The chunks it computes, and those a slower tier supplied, are
admitted to the faster tiers when the step is planned, as any store, with their evictions.

vLLM's ``Request`` and ``SchedulerOutput`` are used duck-typed: no vLLM import here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config.blend import BlendSettings
from ..engine.blend_jobs import BlendJob, SegmentChunkJob
from ..engine.index import TierIndex
from ..engine.jobs import CPU, DISK, REMOTE, StepPlan
from ..engine.keys import key_fingerprint
from ..engine.outcomes import BlendOutcome, FailureReason, RequestSummary, SaveSkipReason
from ..engine.policy import trace_headers
from ..engine.segment_keys import SegmentChunk, cut_chunks
from ..engine.segment_records import PREFIX_BYTES
from ..engine.segments import cut
from .scheduler_state import SchedulerState
from .step_planner import StepPlanner

logger = logging.getLogger("vllm.kvlens")

LATE_STEPS = 8  # steps a finished blended request waits for its report
FOUND_BAD = frozenset({FailureReason.MISSING, FailureReason.CORRUPT})
LOCAL_TIERS = (CPU, DISK)


@dataclass
class PendingBlend:
    request_id: str
    token_ids: tuple[int, ...]
    first: int  # vLLM's own hit
    chunks: list[tuple[SegmentChunk, str | None]]  # each reusable chunk and the tier to read it from
    namespace: str
    stores: bool  # the request may store (its policy's save_skip_reason was None)
    block_ids: tuple[int, ...] = ()
    trace: Any = None

    @property
    def external(self) -> int:
        return len(self.token_ids) - 1 - self.first


@dataclass
class SchedulerBlend:
    settings: BlendSettings
    separators: Sequence[Sequence[int]]  # the separator's token ids (and variants)
    chunk_size: int
    state: SchedulerState
    planner: StepPlanner
    pending: dict[str, PendingBlend] = field(default_factory=dict)  # looked up, not allocated
    ready: dict[str, PendingBlend] = field(default_factory=dict)  # allocated, for the next plan
    # sent to the workers, not reported yet: the request's tenant label (engine/tenants.py)
    running: dict[str, str] = field(default_factory=dict)
    details: dict[str, dict[str, object]] = field(default_factory=dict)  # reported, until finished
    # Ended before their report came (vLLM ends a request in the step's output, before the
    # workers' report is read): the response's params, filled in when it comes, and steps waited.
    awaiting: dict[str, tuple[dict[str, Any] | None, int]] = field(default_factory=dict)
    # The request log's side: a summary of a request still awaiting its report is held until it
    # comes (or is given up); the details of ended requests whose summary is not taken yet.
    held: dict[str, RequestSummary] = field(default_factory=dict)
    released: list[RequestSummary] = field(default_factory=list)
    for_log: dict[str, dict[str, object]] = field(default_factory=dict)

    # ---- lookup --------------------------------------------------------------------------
    def lookup(self, request: Any, num_computed_tokens: int, prefix_tokens: int) -> int | None:
        """Tokens the blend supplies beyond vLLM's hit, or None: this request does not blend
        (``prefix_tokens``: what KVLens's prefix chunks would load)."""
        rid = request.request_id
        self._drop(rid)  # vLLM asks again at each step until it schedules the request
        s = self.state
        prompt = tuple(int(t) for t in (request.prompt_token_ids or ()))
        external = len(prompt) - 1 - num_computed_tokens
        if external <= 0 or prefix_tokens >= external:
            return None
        policy, hasher = s.policies.get(rid), s.hashers.get(rid)
        if policy is None or policy.namespace is None or hasher is None:
            return None  # KVLens neither loads nor stores for it
        parts = cut(prompt, self.separators, self.settings.min_tokens)
        if not parts.separators:
            return None
        chunks = cut_chunks(hasher.namespace, prompt, parts, self.chunk_size)
        if not chunks:
            return None
        found = [(c, self._where(c.digest.hex())) for c in chunks]
        pins = [(s.tiers[t], c.digest.hex()) for c, t in found if t in LOCAL_TIERS]
        s.pins.add(_owner(rid), pins)
        self.pending[rid] = PendingBlend(
            rid,
            prompt,
            num_computed_tokens,
            found,
            key_fingerprint(hasher.namespace),
            policy.save_skip_reason in (None, SaveSkipReason.BLENDED) and s.facts.stores,
        )
        return external

    def _where(self, name: str) -> str | None:
        s = self.state
        for tier in LOCAL_TIERS:
            index = s.tiers.get(tier)
            if index is not None and s.usable(tier) and name in index:
                return tier
        if s.remote is not None and s.usable(REMOTE):
            return REMOTE  # Redis holds what it holds: the workers try, and compute on a miss
        return None

    def after_alloc(self, request: Any, num_external_tokens: int, block_ids: list[int] | None) -> bool:
        """vLLM allocated the request's blocks: True if they are the blend's (the prefix path
        then loads nothing for it and stores none of its chunks)."""
        rid = request.request_id
        blend = self.pending.pop(rid, None)
        if blend is None:
            return False
        if num_external_tokens != blend.external or not block_ids:
            self.state.pins.release(_owner(rid))
            return False
        blend.block_ids = tuple(block_ids)
        blend.trace = trace_headers(request)
        self.ready[rid] = blend
        policy = self.state.policies.get(rid)
        if policy is not None and policy.save_skip_reason is None:
            self.state.policies[rid] = dataclasses.replace(policy, save_skip_reason=SaveSkipReason.BLENDED)
        return True

    # ---- plan ----------------------------------------------------------------------------
    def plan(self, plan: StepPlan) -> list[BlendJob]:
        """The blends of requests allocated since the last plan, their stores admitted."""
        jobs = []
        for rid, blend in self.ready.items():
            jobs.append(self._job(plan, blend))
            self.running[rid] = self.state.tenants.request_label(rid)
        self.ready = {}
        return jobs

    def _job(self, plan: StepPlan, blend: PendingBlend) -> BlendJob:
        s = self.state
        policy = s.policies.get(blend.request_id)
        chunks = []
        for chunk, tier in blend.chunks:
            name = chunk.digest.hex()
            store_to: list[str] = []
            if blend.stores and tier not in LOCAL_TIERS:  # computed here, or read from the remote
                held: list[tuple[TierIndex, str]] = []
                nbytes = self._payload_bytes(chunk.num_tokens)
                store_to = self.planner.admit(plan, chunk.key, held, policy, nbytes)
                for index, key in held:
                    index.unpin(key)
                s.tenants_hold(store_to, name, blend.request_id, chunk.num_tokens)
            chunks.append(SegmentChunkJob(name, chunk.start, chunk.num_tokens, tier, tuple(store_to)))
        return BlendJob(
            blend.request_id,
            blend.token_ids,
            blend.block_ids,
            blend.first,
            tuple(chunks),
            blend.namespace,
            blend.trace,
        )

    def _payload_bytes(self, tokens: int) -> int:
        """One rank's payload of a segment chunk: its KV token-major, and its 16-byte prefix."""
        facts = self.state.facts
        return PREFIX_BYTES + tokens * facts.block_bytes * facts.num_layers // facts.block_size

    # ---- reports and ends ----------------------------------------------------------------
    def reported(self, outcomes: dict[str, BlendOutcome]) -> None:
        for rid, outcome in outcomes.items():
            label = self.running.pop(rid, None)
            if label is not None and not outcome.failed:
                self.state.tenants.blended(label, outcome.reused, outcome.recomputed)
            self.state.pins.release(_owner(rid))
            for problem in outcome.problems:
                if problem.reason in FOUND_BAD and problem.tier != REMOTE:
                    self.state.forget(problem.tier, problem.name, problem.reason)
            details = outcome.details()
            if rid in self.awaiting:
                params, _ = self.awaiting.pop(rid)
                if params is not None:
                    attach(params, details)
                if rid in self.held:
                    self.released.append(dataclasses.replace(self.held.pop(rid), blend=details))
                else:
                    self.for_log[rid] = details
            elif label is not None:  # still running: its finish takes them
                self.details[rid] = details
            if outcome.failed:
                logger.warning(
                    "KVLens: request %s was not blended (%s); vLLM computed it", rid, outcome.failed
                )

    def finish(self, request_id: str, params: dict[str, Any] | None) -> None:
        """The request ended: its response's ``params`` say what its blend did, now or (still
        running) when the workers report, within the same step's output."""
        self._drop(request_id)
        self.ready.pop(request_id, None)
        details = self.details.pop(request_id, None)
        if request_id in self.running:  # a blend still running keeps its pins until reported
            self.awaiting[request_id] = (params, 0)
        else:
            self.state.pins.release(_owner(request_id))
        if details is not None:
            self.for_log[request_id] = details
            if params is not None:
                attach(params, details)

    def with_details(self, done: list[RequestSummary]) -> list[RequestSummary]:
        """Finished requests' summaries for the request log, each with its blend's details: one
        whose report is still awaited is held back until it comes (or is given up)."""
        out = []
        for summary in done:
            rid = summary.request_id
            if rid in self.awaiting:
                self.held[rid] = summary
                continue
            details = self.for_log.pop(rid, None)
            out.append(summary if details is None else dataclasses.replace(summary, blend=details))
        out += self.released
        self.released = []
        return out

    def step_done(self) -> None:
        """A report that never came (its step was abandoned) is not waited for forever."""
        for rid, (params, steps) in list(self.awaiting.items()):
            if steps + 1 >= LATE_STEPS:
                del self.awaiting[rid]
                self.running.pop(rid, None)  # a report later still keeps nothing
                if rid in self.held:
                    self.released.append(self.held.pop(rid))
            else:
                self.awaiting[rid] = (params, steps + 1)

    def _drop(self, request_id: str) -> None:
        if self.pending.pop(request_id, None) is not None:
            self.state.pins.release(_owner(request_id))


def attach(params: dict[str, Any], details: dict[str, Any]) -> None:
    """A blended response's ``kvlens.blend``; its reused tokens are what KVLens supplied."""
    params.setdefault("kvlens", {})["blend"] = details
    params["num_lmcache_cached_tokens"] = sum(details.get("reused_tokens", {}).values())


def _owner(request_id: str) -> str:
    """Pins of a request's blend, apart from those of its prefix lookup."""
    return f"{request_id}\x00blend"
