"""The failed-load event log: whole lines, readable while written, rotated at a size limit."""

from __future__ import annotations

import json
import multiprocessing as mp
import os

from telemetry.events import EventLog, load_failed_event, read_events


def event(i: int) -> dict:
    return load_failed_event(f"req-{i}", ["disk"], [3, 1, 2], 384, "corrupt: checksum", True, "0", "tiny")


def test_event_has_the_fields_operators_need():
    e = event(1)
    assert {"time", "request_id", "tier", "block_ids", "tokens_affected", "reason", "recomputed"} <= set(e)
    assert e["block_ids"] == [1, 2, 3] and e["tier"] == "disk" and e["recomputed"] is True


def test_each_event_is_one_json_line(tmp_path):
    log = EventLog(str(tmp_path / "sub" / "events.jsonl"))
    for i in range(3):
        assert log.append(event(i))
    lines = (tmp_path / "sub" / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["request_id"] for line in lines] == ["req-0", "req-1", "req-2"]


def test_rotation_keeps_backups_and_never_splits_a_line(tmp_path):
    path = str(tmp_path / "events.jsonl")
    line_len = len(json.dumps(event(0), separators=(",", ":"))) + 1
    log = EventLog(path, max_bytes=line_len * 3, backups=2)
    for i in range(10):
        log.append(event(i))
    assert os.path.getsize(path) <= line_len * 3
    assert os.path.exists(path + ".1") and os.path.exists(path + ".2") and not os.path.exists(path + ".3")
    ids = [e["request_id"] for e in read_events(path)]
    assert ids == [f"req-{i}" for i in range(10 - len(ids), 10)]  # oldest dropped, order kept


def _writer(path: str, start: int, n: int) -> None:
    log = EventLog(path, max_bytes=20_000, backups=50)
    for i in range(start, start + n):
        log.append(event(i))


def test_concurrent_writers_and_a_reader_see_only_whole_events(tmp_path):
    path = str(tmp_path / "events.jsonl")
    ctx = mp.get_context("fork")
    writers = [ctx.Process(target=_writer, args=(path, k * 1000, 200)) for k in range(3)]
    for w in writers:
        w.start()
    seen_while_writing = 0
    while any(w.is_alive() for w in writers):
        seen_while_writing = max(seen_while_writing, len(list(read_events(path))))
    for w in writers:
        w.join(timeout=60)
        assert w.exitcode == 0
    files = [path] + [f"{path}.{i}" for i in range(1, 51) if os.path.exists(f"{path}.{i}")]
    raw = [line for f in files for line in open(f).read().splitlines()]
    assert len(raw) == 600 and all(json.loads(line)["event"] == "load_failed" for line in raw)
    assert len({json.loads(line)["request_id"] for line in raw}) == 600


def test_unwritable_log_does_not_raise(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert EventLog(str(blocker / "events.jsonl")).append(event(0)) is False


def test_the_event_log_is_private_and_never_follows_a_symlink(tmp_path):
    import stat

    log_dir = tmp_path / "state" / "kvlens"
    log = EventLog(str(log_dir / "events.jsonl"))
    assert log.append({"event": "x"})
    assert stat.S_IMODE(os.stat(log.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(log_dir).st_mode) == 0o700
    target = tmp_path / "elsewhere"
    target.write_text("")
    trap = tmp_path / "trap.jsonl"
    trap.symlink_to(target)
    assert EventLog(str(trap)).append({"event": "x"}) is False
    assert target.read_text() == ""


def test_the_default_event_log_is_per_user(tmp_path):
    from telemetry.settings import default_event_log

    assert default_event_log({"XDG_STATE_HOME": str(tmp_path)}) == str(
        tmp_path / "kvlens" / "kvlens-events.jsonl"
    )
    assert default_event_log({"HOME": str(tmp_path)}).startswith(
        str(tmp_path / ".local" / "state" / "kvlens")
    )
    assert f"kvlens-{os.getuid()}" in default_event_log({"HOME": "/nonexistent-home"})


def test_torn_and_garbage_lines_are_skipped_and_counted(tmp_path):
    from telemetry.events import ReadCounts

    path = tmp_path / "events.jsonl"
    EventLog(str(path)).append(event(0))
    with open(path, "ab") as f:
        f.write(b'{"event": "load_fa\n\xff\xfe garbage\n[1, 2]\n\n')
    EventLog(str(path)).append(event(1))
    with open(path, "ab") as f:
        f.write(b'{"event": "load_failed", "request_id": "torn')
    counts = ReadCounts()
    assert [e["request_id"] for e in read_events(str(path), counts=counts)] == ["req-0", "req-1"]
    assert (counts.read, counts.skipped) == (2, 4)
