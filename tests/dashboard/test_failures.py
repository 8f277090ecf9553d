"""Failed-load events read from KVLens's own event log files (rotation included)."""

from __future__ import annotations

from dashboard import failures
from telemetry.events import EventLog, load_failed_event

from .conftest import write_events


def test_events_of_several_logs_newest_first(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_events(a, ("cmpl-1-0", "disk", 4, "corrupt: checksum mismatch"))
    write_events(
        b, ("cmpl-2-0", "cpu", 2, "missing: not found"), ("cmpl-3-0", "disk", 1, "truncated: 10 bytes")
    )
    events, statuses = failures.load_events([str(a), str(b)])
    assert [s.state for s in statuses] == [failures.READ, failures.READ]
    assert list(events["request_id"]) == ["cmpl-3-0", "cmpl-2-0", "cmpl-1-0"]
    first = events.iloc[-1]
    assert (first["tier"], first["reason_kind"], first["num_blocks"], first["tokens_affected"]) == (
        "disk",
        "corrupt",
        4,
        512,
    )
    assert first["recomputed"] and first["log"] == str(a)


def test_rotated_files_are_read_too(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog(str(path), max_bytes=400)
    for i in range(4):
        log.append(load_failed_event(f"r{i}", ["disk"], [1, 2], 256, "corrupt: x", True, "0", "m"))
    assert (tmp_path / "events.jsonl.1").exists()
    events, _ = failures.load_events([str(path)])
    assert sorted(events["request_id"]) == ["r0", "r1", "r2", "r3"]


def test_missing_and_empty_logs_are_no_events_yet(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    events, statuses = failures.load_events([str(tmp_path / "nope.jsonl"), str(empty)])
    assert events.empty
    assert [s.state for s in statuses] == [failures.MISSING, failures.EMPTY]


def test_filters(tmp_path):
    path = tmp_path / "e.jsonl"
    write_events(path, ("cmpl-abc-0", "disk", 4, "corrupt: x"), ("cmpl-def-0", "cpu", 2, "missing: y"))
    events, _ = failures.load_events([str(path)])
    assert list(failures.filter_events(events, tiers=["cpu"])["request_id"]) == ["cmpl-def-0"]
    assert list(failures.filter_events(events, reasons=["corrupt"])["request_id"]) == ["cmpl-abc-0"]
    assert list(failures.filter_events(events, request_id="abc")["request_id"]) == ["cmpl-abc-0"]
    assert len(failures.filter_events(events)) == 2
    summary = failures.summary(events).set_index("tier")
    assert summary.loc["disk", "blocks"] == 4 and summary.loc["cpu", "tokens recomputed"] == 256


def test_reason_kind():
    assert failures.reason_kind("corrupt: checksum mismatch: a:b") == "corrupt"
    assert failures.reason_kind(None) == "unknown"
