"""Finished requests read from KVLens's own request log files (rotation and torn lines included):
find one, list the requests that missed for a reason, count the reasons."""

from __future__ import annotations

import os

from dashboard import logfiles, request_records
from dashboard.request_records import (
    COLUMNS,
    explain,
    find_request,
    load_requests,
    miss_reason_counts,
    requests_missing_for,
)

from .conftest import write_requests


def test_requests_of_several_logs_newest_first_with_their_story(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_requests(a, ("cmpl-1-0", "evicted", 100.0), ("cmpl-2-0", None, 101.0))
    write_requests(b, ("cmpl-3-0", "not_stored", 102.0))
    frame, statuses = load_requests([str(a), str(b)])
    assert [s.state for s in statuses] == [logfiles.READ, logfiles.READ]
    assert list(frame["request_id"]) == ["cmpl-3-0", "cmpl-2-0", "cmpl-1-0"]
    first = frame.iloc[-1]
    assert (first["miss_reason"], first["miss_detail"], first["kvlens_tokens_by_tier"]) == (
        "evicted",
        "tier=cpu, evicted_s_ago=12.5",
        "cpu=256",
    )
    assert (first["prompt_tokens"], first["computed_tokens"], first["log"]) == (1000, 744, str(a))
    assert frame.iloc[1]["miss_reason"] == "" and frame["load_ms"].isna().all()
    assert explain(first) == (
        "cmpl-1-0: 1,000 prompt tokens: 0 from vLLM's prefix cache, 256 from KVLens (cpu=256), "
        "744 computed. Missed: evicted (tier=cpu, evicted_s_ago=12.5)."
    )


def test_an_empty_or_missing_log_gives_the_same_columns(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    frame, statuses = load_requests([str(tmp_path / "nope.jsonl"), str(empty)])
    assert frame.empty and tuple(frame.columns) == COLUMNS
    assert [s.state for s in statuses] == [logfiles.MISSING, logfiles.EMPTY]
    assert find_request(frame, "x").empty and requests_missing_for(frame, "evicted").empty
    counts = miss_reason_counts(frame)
    assert counts.empty and tuple(counts.columns) == request_records.COUNT_COLUMNS
    assert dict(frame.dtypes.astype(str))["prompt_tokens"] == "int64"


def test_rotated_backups_are_read_and_torn_or_garbage_lines_counted(tmp_path):
    path = tmp_path / "requests.jsonl"
    write_requests(path, *[(f"cmpl-{i}-0", "evicted", 100.0 + i) for i in range(6)], max_bytes=1500)
    assert (tmp_path / "requests.jsonl.1").exists()
    with open(f"{path}.1", "ab") as f:
        f.write(b'{"event": "request", "request_id": "cmpl-to\n\x00\xffgarbage\n')
    with open(path, "ab") as f:
        f.write(b'{"event": "request", "request_id": "x", "prompt_tokens": "many"}\n')
        f.write(b'{"event": "request", "request_id": "torn", "prompt')
    frame, statuses = load_requests([str(path)])
    assert sorted(frame["request_id"]) == [f"cmpl-{i}-0" for i in range(6)]
    assert statuses[0].state == logfiles.READ and statuses[0].skipped == 4


def test_find_a_request_by_exact_id_then_by_prefix(tmp_path):
    path = tmp_path / "r.jsonl"
    write_requests(path, ("cmpl-ab-0", None, 1.0), ("cmpl-ab-0-x", None, 2.0), ("cmpl-abc-0", None, 3.0))
    frame, _ = load_requests([str(path)])
    assert list(find_request(frame, "cmpl-ab-0")["request_id"]) == ["cmpl-ab-0"]
    assert list(find_request(frame, " cmpl-ab")["request_id"]) == ["cmpl-abc-0", "cmpl-ab-0-x", "cmpl-ab-0"]
    assert find_request(frame, "other").empty and find_request(frame, "  ").empty


def test_requests_missing_for_a_reason_and_the_counts(tmp_path):
    path = tmp_path / "r.jsonl"
    write_requests(
        path,
        ("r1", "evicted", 1.0),
        ("r2", "not_stored", 2.0),
        ("r3", "evicted", 3.0),
        ("r4", None, 4.0),
    )
    frame, _ = load_requests([str(path)])
    assert list(requests_missing_for(frame, "evicted")["request_id"]) == ["r3", "r1"]
    counts = miss_reason_counts(frame)
    assert counts.to_dict("records") == [
        {"miss_reason": "evicted", "requests": 2, "computed_tokens": 744 * 2},
        {"miss_reason": "not_stored", "requests": 1, "computed_tokens": 744},
    ]


def test_the_stamp_changes_when_a_log_grows_or_rotates(tmp_path):
    path = tmp_path / "r.jsonl"
    before = logfiles.stamp([str(path)])
    assert before == ((str(path), -1, -1),)
    write_requests(path, ("r1", None, 1.0))
    grown = logfiles.stamp([str(path)])
    assert grown != before and grown[0][2] == os.path.getsize(path)
    os.replace(path, f"{path}.1")
    assert [name for name, _, _ in logfiles.stamp([str(path)])] == [str(path), f"{path}.1"]
