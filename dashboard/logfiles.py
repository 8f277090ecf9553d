"""Reading KVLens JSON-lines logs (failed loads, finished requests) for the dashboard: every
file with its rotated backups, one status per log, and never an exception."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from telemetry.events import ReadCounts, read_events

MISSING, EMPTY, READ = "missing", "empty", "read"


@dataclass(frozen=True, slots=True)
class LogStatus:
    path: str
    state: str  # MISSING (no file yet), EMPTY (nothing of the kind asked for) or READ
    events: int = 0
    detail: str = ""
    skipped: int = 0  # torn or garbage lines, and records that would not make a row


def read_logs(
    paths: Iterable[str], event: str, to_row: Callable[[dict[str, Any], str], dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[LogStatus]]:
    """Rows ``to_row(record, path)`` for the records of kind ``event`` in every log, and each
    log's status. A record ``to_row`` cannot convert is skipped and counted, like a torn line."""
    rows: list[dict[str, Any]] = []
    statuses = []
    for path in paths:
        if not os.path.exists(path):
            statuses.append(LogStatus(path, MISSING, detail="no such file yet"))
            continue
        counts, found, bad = ReadCounts(), [], 0
        try:
            for record in read_events(path, counts=counts):
                if record.get("event") != event:
                    continue
                try:
                    found.append(to_row(record, path))
                except (TypeError, ValueError, AttributeError, OverflowError):
                    bad += 1
        except OSError as e:
            statuses.append(LogStatus(path, MISSING, detail=str(e)))
            continue
        rows.extend(found)
        statuses.append(LogStatus(path, READ if found else EMPTY, len(found), skipped=counts.skipped + bad))
    return rows, statuses


def stamp(paths: Iterable[str]) -> tuple[tuple[str, int, int], ...]:
    """(path, mtime_ns, size) of every log file and backup: a cache key that changes whenever
    a writer appends or rotates."""
    out = []
    for path in paths:
        i = 0
        while True:
            name = path if i == 0 else f"{path}.{i}"
            try:
                st = os.stat(name)
            except OSError:
                if i > 0:
                    break
                out.append((name, -1, -1))
            else:
                out.append((name, st.st_mtime_ns, st.st_size))
            i += 1
    return tuple(out)
