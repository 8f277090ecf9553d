"""Failed-load events from one or more KVLens event logs (``KVLENS_EVENT_LOG``), as a frame
for the timeline and the filterable table."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pandas as pd

from telemetry.events import LOAD_FAILED

from .logfiles import EMPTY, MISSING, READ, LogStatus, read_logs  # noqa: F401  (states callers read here)

COLUMNS = (
    "time",
    "request_id",
    "tier",
    "reason_kind",
    "reason",
    "num_blocks",
    "tokens_affected",
    "recomputed",
    "engine",
    "model",
    "log",
)


def reason_kind(reason: str | None) -> str:
    """``"corrupt: checksum mismatch in ..."`` -> ``"corrupt"`` (the label the metrics use)."""
    return (reason or "unknown").split(":", 1)[0].strip() or "unknown"


def _row(event: dict, log: str) -> dict:
    return {
        "time": pd.to_datetime(event.get("ts", 0), unit="s", utc=True),
        "request_id": str(event.get("request_id", "")),
        "tier": event.get("tier") or "?",
        "reason_kind": reason_kind(event.get("reason")),
        "reason": event.get("reason") or "",
        "num_blocks": int(event.get("num_blocks") or len(event.get("block_ids") or ())),
        "tokens_affected": int(event.get("tokens_affected") or 0),
        "recomputed": bool(event.get("recomputed")),
        "engine": str(event.get("engine", "")),
        "model": str(event.get("model", "")),
        "log": log,
    }


def load_events(paths: Iterable[str], limit: int = 5000) -> tuple[pd.DataFrame, list[LogStatus]]:
    """The newest ``limit`` failed-load events of all logs (rotated files included), newest
    first, and per log whether it exists and holds any. Never raises."""
    rows, statuses = read_logs(paths, LOAD_FAILED, _row)
    frame = pd.DataFrame(rows, columns=list(COLUMNS))
    if not frame.empty:
        frame = frame.sort_values("time", ascending=False).head(limit).reset_index(drop=True)
    return frame, statuses


def filter_events(
    events: pd.DataFrame,
    tiers: Sequence[str] = (),
    reasons: Sequence[str] = (),
    request_id: str = "",
    logs: Sequence[str] = (),
) -> pd.DataFrame:
    """Events matching every filter given (an empty filter matches all)."""
    keep = pd.Series(True, index=events.index)
    if tiers:
        keep &= events["tier"].isin(list(tiers))
    if reasons:
        keep &= events["reason_kind"].isin(list(reasons))
    if logs:
        keep &= events["log"].isin(list(logs))
    if request_id.strip():
        keep &= events["request_id"].str.contains(request_id.strip(), regex=False)
    return events[keep]


def summary(events: pd.DataFrame) -> pd.DataFrame:
    """Failed loads, blocks and recomputed tokens per tier and reason."""
    if events.empty:
        return pd.DataFrame(columns=["tier", "reason_kind", "events", "blocks", "tokens recomputed"])
    return (
        events.groupby(["tier", "reason_kind"])
        .agg(
            events=("request_id", "size"),
            blocks=("num_blocks", "sum"),
            **{"tokens recomputed": ("tokens_affected", "sum")},
        )
        .reset_index()
    )
