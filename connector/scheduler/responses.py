"""What a finished request gets back and leaves behind: the response's ``kv_transfer_params``
(``num_lmcache_cached_tokens`` and the ``kvlens`` breakdown) and its summary line.

A request can finish before the report of its load arrives (an abort, or with asynchronous
scheduling a report that comes a step or more late). Its summary then waits for that report,
so the request log says what was loaded; its response has already gone with what was known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..engine.namespaces import client_miss_reason
from ..engine.outcomes import LookupOutcome, MissReason, RequestSummary
from ..engine.tracker import LookupResult, RequestTracker
from .prefix_lookup import PrefixLookup
from .scheduler_state import SchedulerState

# A finished request whose load has not been reported after this many steps is logged as is.
LATE_STEPS = 8


@dataclass(frozen=True, slots=True)
class FinishResult:
    params: dict[str, Any] | None  # the response's kv_transfer_params
    unscheduled_lookup: LookupOutcome | None  # a lookup that never reached a schedule


class Responses:
    def __init__(self, state: SchedulerState, lookup: PrefixLookup) -> None:
        self._s = state
        self._lookup = lookup
        # Finished before their load was reported: request id -> (tracker, params, reports seen)
        self._late: dict[str, tuple[RequestTracker, dict[str, Any] | None, int]] = {}
        self.done: list[RequestSummary] = []  # finished requests, drained by the facade

    def finish(self, request: Any) -> FinishResult:
        s = self._s
        rid = request.request_id
        if rid in s.async_loading:  # its chunks are being read: pinned until the workers report
            s.async_cancels.append(rid)
        else:
            s.pins.release(rid)
        if s.remote is not None:
            s.remote.forget(rid)
        s.unfinished.pop(rid, None)
        s.policies.pop(rid, None)
        s.hashers.pop(rid, None)
        s.async_outcomes.pop(rid, None)
        result = s.lookups.pop(rid, None)
        tracker = s.trackers.pop(rid, None)
        unscheduled = None
        if tracker is None and result is not None:
            unscheduled = self._lookup.outcome(request, result, scheduled=False)
        params = self._params(tracker, result, unscheduled)
        if tracker is not None and tracker.load_pending:  # its load is reported later
            self._late[rid] = (tracker, params, 0)
        elif tracker is not None:
            self.done.append(summary(tracker))
        elif unscheduled is not None:
            self.done.append(_unscheduled_summary(unscheduled, result))
        return FinishResult(params, unscheduled)

    def late_tracker(self, request_id: str) -> RequestTracker | None:
        late = self._late.get(request_id)
        return late[0] if late is not None else None

    def late_trackers(self) -> list[RequestTracker]:
        return [late[0] for late in self._late.values()]

    def load_reported(self, request_id: str) -> None:
        """The load of a request that finished before it is reported: its summary is complete."""
        late = self._late.pop(request_id, None)
        if late is None:
            return
        tracker, params, _ = late
        if params is not None:
            params["kvlens"] = for_client(tracker.usage())
        self.done.append(summary(tracker))

    def step_done(self) -> None:
        """A step's output arrived; late requests still waiting after ``LATE_STEPS`` steps
        (their load's report was lost) are logged as they are."""
        for rid, (tracker, params, seen) in list(self._late.items()):
            if seen + 1 >= LATE_STEPS:
                del self._late[rid]
                self.done.append(summary(tracker))
            else:
                self._late[rid] = (tracker, params, seen + 1)

    def _params(
        self, tracker: RequestTracker | None, result: LookupResult | None, unscheduled: LookupOutcome | None
    ) -> dict[str, Any] | None:
        """The response's kv_transfer_params (None when usage details are turned off)."""
        if not self._s.config.extra_config.enable_cache_usage_details_in_response:
            return None
        hit = tracker.hit_tokens if tracker else (result.hit_tokens if result else 0)
        params: dict[str, Any] = {"num_lmcache_cached_tokens": hit}
        if tracker is not None:
            params["kvlens"] = for_client(tracker.usage())
        elif unscheduled is not None:
            reason = result.miss_reason if result is not None else unscheduled.miss_reason
            usage = {
                "vllm_cached_tokens": unscheduled.vllm_cached_tokens,
                "hit_tokens": unscheduled.hit_tokens,
                "miss_reason": reason.value if reason else None,
            }
            if result is not None and result.miss_detail:
                usage["miss_detail"] = result.miss_detail
            params["kvlens"] = for_client(usage)
        return params

    def take_done(self) -> list[RequestSummary]:
        done, self.done = self.done, []
        return done


def for_client(usage: dict[str, Any]) -> dict[str, Any]:
    """The usage a response carries. A miss because the prompt is stored only under another
    tenant's namespace (another cache salt or tags) reads ``not_stored`` there (the request log,
    for the operator, keeps ``other_namespace``): cache_salt exists so that tenants cannot learn
    each other's prompts (``engine/namespaces.py``)."""
    detail = usage.get("miss_detail")
    if (
        usage.get("miss_reason") == MissReason.OTHER_NAMESPACE.value
        and client_miss_reason(MissReason.OTHER_NAMESPACE, detail if isinstance(detail, dict) else None)
        is not MissReason.OTHER_NAMESPACE
    ):
        usage = {k: v for k, v in usage.items() if k != "miss_detail"}
        usage["miss_reason"] = MissReason.NOT_STORED.value
    return usage


def summary(tracker: RequestTracker) -> RequestSummary:
    return RequestSummary(
        request_id=tracker.request_id,
        prompt_tokens=tracker.prompt_len,
        vllm_cached_tokens=tracker.vllm_cached_tokens,
        loaded_tokens=dict(tracker.loaded_tokens),
        miss_reason=tracker.miss_reason,
        miss_detail=tracker.miss_detail,
        load_seconds=tracker.load_seconds if tracker.planned_load_tokens else None,
        stored_chunks=tracker.stored_chunks,
        failed_blocks=tracker.failed_blocks,
        failure_reasons=tuple(tracker.failure_reasons),
        trace_context=tracker.trace_context,
    )


def _unscheduled_summary(outcome: LookupOutcome, result: LookupResult | None) -> RequestSummary:
    return RequestSummary(
        request_id=outcome.request_id,
        prompt_tokens=outcome.prompt_tokens,
        vllm_cached_tokens=outcome.vllm_cached_tokens,
        loaded_tokens={},
        miss_reason=result.miss_reason if result is not None else outcome.miss_reason,  # the operator's
        miss_detail=result.miss_detail if result is not None else None,
        load_seconds=None,
        stored_chunks=0,
        failed_blocks=0,
        failure_reasons=(),
        trace_context=outcome.trace_context,
    )
