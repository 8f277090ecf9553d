"""Output samples the docs show (```json sample=<what>), rebuilt with the code that writes them:
a sample whose fields or arithmetic drift from KVLens's own output fails."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from connector.engine.outcomes import BlendOutcome, ChunkProblem, FailureReason, MissReason, SaveSkipReason
from connector.engine.tracker import RequestTracker
from telemetry.events import load_failed_event
from telemetry.request_log import request_record


def response(sample: dict[str, Any]) -> None:
    """A response's ``kv_transfer_params``: what ``RequestTracker.usage()`` reports."""
    params = sample["kv_transfer_params"]
    shown = params["kvlens"]
    assert params["num_lmcache_cached_tokens"] == shown["hit_tokens"]
    tracker = RequestTracker("req", 0, None, [], 0, 0)  # type: ignore[arg-type]
    tracker.vllm_cached_tokens = shown["vllm_cached_tokens"]
    tracker.hit_tokens = shown["hit_tokens"]
    tracker.loaded_tokens = dict(shown["loaded_tokens"])
    tracker.load_seconds = shown["load_ms"] / 1000
    tracker.failed_blocks = shown["failed_blocks"]
    tracker.recomputed_tokens = shown["recomputed_tokens"]
    miss, skip = shown["miss_reason"], shown["save_skip_reason"]
    tracker.miss_reason = MissReason(miss) if miss else None
    tracker.save_skip_reason = SaveSkipReason(skip) if skip else None
    assert tracker.usage() == shown


def request_log(sample: dict[str, Any]) -> None:
    """A request log line: ``request_record`` given the sample's inputs writes the same line."""
    rebuilt = request_record(
        request_id=sample["request_id"],
        engine=sample["engine"],
        model=sample["model"],
        prompt_tokens=sample["prompt_tokens"],
        vllm_cached_tokens=sample["vllm_cached_tokens"],
        kvlens_tokens_by_tier=sample["kvlens_tokens_by_tier"],
        lookup_ms=sample["lookup_ms"],
        miss_reason=MissReason(sample["miss_reason"]) if sample["miss_reason"] else None,
        miss_detail=sample["miss_detail"],
        load_ms=sample["load_ms"],
        stored_chunks=sample["stored_chunks"],
        failed=sample["failed"],
        failure_reasons=sample["failure_reasons"],
        trace_id=sample["trace_id"],
        now=sample["ts"],
    )
    assert list(sample) == list(rebuilt)
    assert sample == rebuilt


def failed_load_event(sample: dict[str, Any]) -> None:
    """A failed-load event line: ``load_failed_event`` with the sample's inputs, time aside."""
    rebuilt = load_failed_event(
        sample["request_id"],
        sample["tiers"],
        sample["block_ids"],
        sample["tokens_affected"],
        sample["reason"],
        sample["recomputed"],
        sample["engine"],
        sample["model"],
    )
    assert list(sample) == list(rebuilt)
    clock = ("time", "ts")
    assert {k: v for k, v in sample.items() if k not in clock} == {
        k: v for k, v in rebuilt.items() if k not in clock
    }
    FailureReason(sample["reason"].split(":")[0])  # the event's reason starts with one of the list


def blend(sample: dict[str, Any]) -> None:
    """A blended response's ``kvlens.blend``: what ``BlendOutcome.details()`` reports."""
    outcome = BlendOutcome(
        "req",
        tokens=sample["tokens"],
        reused_by_tier=dict(sample["reused_tokens"]),
        recomputed=sample["recomputed_tokens"],
        by_deviation=sample["recomputed_by_deviation"],
        not_reused=sample["recomputed_not_stored"],
        stored=sample["stored_chunks"],
        deviation_mean=sample.get("deviation_mean"),
        deviation_max=sample.get("deviation_max"),
        problems=[
            ChunkProblem(c["tier"], "chunk", FailureReason(c["reason"]))
            for c in sample.get("unreadable_chunks", [])
        ],
        failed=sample.get("failed"),
    )
    assert outcome.details() == sample
    assert outcome.recomputed >= outcome.by_deviation + outcome.not_reused - 1  # the last token


SAMPLE_CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "blend": blend,
    "response": response,
    "request_log": request_log,
    "load_failed_event": failed_load_event,
}
