"""Finished requests from one or more KVLens request logs (``KVLENS_REQUEST_LOG``), as a frame
to answer "why did this request miss?": find a request, list the requests that missed for a
reason, count the reasons.

(Not ``requests.py``: ``streamlit run`` puts ``dashboard/`` first on ``sys.path``, where that
name would shadow the ``requests`` library.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd

from telemetry.request_log import REQUEST

from .logfiles import LogStatus, read_logs

# The log's fields, with kvlens_tokens_by_tier, miss_detail and failure_reasons as text (so any
# table shows them) and the log file each came from.
DTYPES = {
    "time": "datetime64[ns, UTC]",
    "request_id": object,
    "miss_reason": object,  # "" when KVLens supplied all it could
    "miss_detail": object,
    "prompt_tokens": "int64",
    "vllm_cached_tokens": "int64",
    "kvlens_tokens": "int64",
    "kvlens_tokens_by_tier": object,
    "computed_tokens": "int64",
    "lookup_ms": "float64",
    "load_ms": "float64",  # NaN when nothing was loaded
    "stored_chunks": "int64",
    "failed": bool,
    "failure_reasons": object,
    "trace_id": object,
    "engine": object,
    "model": object,
    "log": object,
}
COLUMNS = tuple(DTYPES)
COUNT_COLUMNS = ("miss_reason", "requests", "computed_tokens")


def _text(value: Any) -> str:
    """{"tier": "cpu", "evicted_s_ago": 12.5} -> "tier=cpu, evicted_s_ago=12.5"."""
    if value is None:
        return ""
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def _float(value: Any) -> float:
    return math.nan if value is None else float(value)


def _row(record: dict[str, Any], log: str) -> dict[str, Any]:
    reasons = record.get("failure_reasons") or ()
    return {
        "time": pd.to_datetime(float(record.get("ts") or 0), unit="s", utc=True),
        "request_id": str(record.get("request_id") or ""),
        "miss_reason": str(record.get("miss_reason") or ""),
        "miss_detail": _text(record.get("miss_detail")),
        "prompt_tokens": int(record.get("prompt_tokens") or 0),
        "vllm_cached_tokens": int(record.get("vllm_cached_tokens") or 0),
        "kvlens_tokens": int(record.get("kvlens_tokens") or 0),
        "kvlens_tokens_by_tier": _text(record.get("kvlens_tokens_by_tier") or None),
        "computed_tokens": int(record.get("computed_tokens") or 0),
        "lookup_ms": _float(record.get("lookup_ms")),
        "load_ms": _float(record.get("load_ms")),
        "stored_chunks": int(record.get("stored_chunks") or 0),
        "failed": bool(record.get("failed")),
        "failure_reasons": "; ".join(str(r) for r in reasons) if isinstance(reasons, list) else str(reasons),
        "trace_id": str(record.get("trace_id") or ""),
        "engine": str(record.get("engine") or ""),
        "model": str(record.get("model") or ""),
        "log": log,
    }


def load_requests(paths: Iterable[str], limit: int = 20_000) -> tuple[pd.DataFrame, list[LogStatus]]:
    """The newest ``limit`` requests of all logs (rotated files included), newest first, with
    ``COLUMNS`` even when there is none, and per log whether it exists, holds any and how many
    lines were skipped. Never raises."""
    rows, statuses = read_logs(paths, REQUEST, _row)
    frame = pd.DataFrame(rows, columns=list(COLUMNS)).astype(DTYPES)
    if not frame.empty:
        frame = frame.sort_values("time", ascending=False, kind="stable").head(limit)
    return frame.reset_index(drop=True), statuses


def find_request(requests: pd.DataFrame, request_id: str) -> pd.DataFrame:
    """The request with this exact id, else those whose id starts with it (vLLM adds suffixes
    to the ids clients send); none for an empty id."""
    wanted = request_id.strip()
    if not wanted:
        return requests.iloc[0:0]
    exact = requests[requests["request_id"] == wanted]
    if not exact.empty:
        return exact
    return requests[requests["request_id"].str.startswith(wanted)]


def requests_missing_for(requests: pd.DataFrame, reason: str) -> pd.DataFrame:
    """The requests whose lookup missed for ``reason`` (a ``MissReason`` value)."""
    return requests[requests["miss_reason"] == reason]


def miss_reason_counts(requests: pd.DataFrame) -> pd.DataFrame:
    """Requests and computed prompt tokens per miss reason, most frequent first."""
    missed = requests[requests["miss_reason"] != ""]
    if missed.empty:
        return pd.DataFrame(
            {c: pd.Series(dtype=object if c == "miss_reason" else "int64") for c in COUNT_COLUMNS}
        )
    counts = (
        missed.groupby("miss_reason")
        .agg(requests=("request_id", "size"), computed_tokens=("computed_tokens", "sum"))
        .reset_index()
    )
    return counts.sort_values(["requests", "miss_reason"], ascending=[False, True]).reset_index(drop=True)


def explain(request: Mapping[str, Any]) -> str:
    """One request's story in a sentence: where its prompt tokens came from and why not more."""
    by_tier = f" ({request['kvlens_tokens_by_tier']})" if request["kvlens_tokens_by_tier"] else ""
    text = (
        f"{request['request_id']}: {request['prompt_tokens']:,} prompt tokens: "
        f"{request['vllm_cached_tokens']:,} from vLLM's prefix cache, "
        f"{request['kvlens_tokens']:,} from KVLens{by_tier}, {request['computed_tokens']:,} computed."
    )
    if request["miss_reason"]:
        detail = f" ({request['miss_detail']})" if request["miss_detail"] else ""
        text += f" Missed: {request['miss_reason']}{detail}."
    if request["failed"]:
        text += f" Load failed: {request['failure_reasons'] or 'no reason recorded'}."
    return text
