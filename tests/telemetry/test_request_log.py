"""The per-request log: one private JSON line per sampled finished request, sampled the same way
in every process, off unless asked for, rotated by the event log's writer."""

from __future__ import annotations

import json
import os
import stat

import pytest

from connector.engine.outcomes import MissReason
from telemetry.events import read_events
from telemetry.request_log import FIELDS, REQUEST, RequestLog, request_record, sampled
from telemetry.settings import TelemetrySettings


def record(request_id: str = "cmpl-1-0", **overrides) -> dict:
    fields = dict(
        request_id=request_id,
        engine="0",
        model="tiny",
        prompt_tokens=1000,
        vllm_cached_tokens=256,
        kvlens_tokens_by_tier={"cpu": 256, "disk": 128},
        lookup_ms=0.1234,
        miss_reason=MissReason.EVICTED,
        miss_detail={"tier": "cpu", "evicted_s_ago": 12.5},
        load_ms=3.0,
        stored_chunks=2,
        trace_id="abc",
        now=1_700_000_000.5,
    )
    fields.update(overrides)
    return request_record(**fields)


def settings(**env) -> TelemetrySettings:
    return TelemetrySettings.from_env(None, env)


def test_a_record_has_the_schema_and_no_prompt_or_token_ids():
    r = record()
    assert tuple(r) == FIELDS
    assert r["event"] == REQUEST and r["time"] == "2023-11-14T22:13:20.500+00:00"
    assert (r["kvlens_tokens"], r["kvlens_tokens_by_tier"], r["computed_tokens"]) == (
        384,
        {"cpu": 256, "disk": 128},
        360,
    )
    assert r["miss_reason"] == "evicted" and r["miss_detail"] == {"tier": "cpu", "evicted_s_ago": 12.5}
    assert (r["lookup_ms"], r["load_ms"], r["failed"], r["failure_reasons"]) == (0.123, 3.0, False, [])
    assert not any(k in r for k in ("prompt", "prompt_text", "token_ids", "prompt_token_ids", "tokens"))


def test_computed_tokens_never_go_below_zero_and_a_full_hit_has_no_reason():
    r = record(prompt_tokens=100, vllm_cached_tokens=64, miss_reason=None, miss_detail=None, load_ms=None)
    assert r["computed_tokens"] == 0 and r["miss_reason"] is None and r["miss_detail"] is None
    assert r["load_ms"] is None


def test_each_sampled_request_is_one_json_line_in_a_private_file(tmp_path):
    log = RequestLog(str(tmp_path / "state" / "requests.jsonl"))
    for i in range(3):
        assert log.append(record(f"cmpl-{i}-0", failed=True, failure_reasons=["corrupt: checksum"]))
    lines = (tmp_path / "state" / "requests.jsonl").read_text().splitlines()
    assert [json.loads(line)["request_id"] for line in lines] == ["cmpl-0-0", "cmpl-1-0", "cmpl-2-0"]
    assert json.loads(lines[0])["failure_reasons"] == ["corrupt: checksum"]
    assert stat.S_IMODE(os.stat(log.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "state").st_mode) == 0o700


def test_a_symlinked_request_log_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("")
    (tmp_path / "trap.jsonl").symlink_to(target)
    assert RequestLog(str(tmp_path / "trap.jsonl")).append(record()) is False
    assert target.read_text() == ""


def test_sampling_is_a_function_of_the_request_id():
    ids = [f"cmpl-{i:05d}-0" for i in range(10_000)]
    first = [sampled(i, 0.3) for i in ids]
    assert first == [sampled(i, 0.3) for i in ids]  # same in every process and every rerun
    assert 0.27 < sum(first) / len(ids) < 0.33
    assert sampled("cmpl-00000-0", 0.3) == RequestLog("/unused", 0.3).wants("cmpl-00000-0")
    assert all(sampled(i, 1.0) for i in ids) and not any(sampled(i, 0.0) for i in ids)
    # a smaller rate keeps a subset of a larger one: lowering it never brings in new ids
    assert all(a for a, b in zip(first, (sampled(i, 0.1) for i in ids), strict=True) if b)


def test_sampling_is_pinned():
    """The hash is part of the file format: logs of two versions, runs or ranks must agree."""
    expected = [True, False, False, False, True, True, False, False, True, True, False, False]
    assert [sampled(f"r{i}", 0.5) for i in range(12)] == expected


def test_an_unsampled_request_writes_nothing(tmp_path):
    path = tmp_path / "requests.jsonl"
    log = RequestLog(str(path), sample=0.0)
    assert log.append(record()) is False
    assert not path.exists() and not tmp_path.joinpath("requests.jsonl.lock").exists()


def test_off_by_default_and_off_writes_no_file(tmp_path):
    assert settings().request_log is None and settings().request_log_sample == 1.0
    assert RequestLog.from_settings(settings(HOME=str(tmp_path))) is None
    assert RequestLog.from_settings(settings(KVLENS_REQUEST_LOG="0")) is None
    assert RequestLog.from_settings(settings(KVLENS_REQUEST_LOG="")) is None
    assert list(tmp_path.iterdir()) == []


def test_settings_from_the_environment(tmp_path):
    path = str(tmp_path / "r.jsonl")
    log = RequestLog.from_settings(
        settings(KVLENS_REQUEST_LOG=path, KVLENS_REQUEST_LOG_SAMPLE="0.25", KVLENS_EVENT_LOG_BACKUPS="5")
    )
    assert log is not None and log.path == path and log.sample == 0.25
    on = settings(KVLENS_REQUEST_LOG="1", XDG_STATE_HOME=str(tmp_path)).request_log
    assert on == str(tmp_path / "kvlens" / "kvlens-requests.jsonl")


@pytest.mark.parametrize("raw", ["abc", "1.5", "-0.1", "nan", "50%"])
def test_a_bad_sample_rate_names_the_variable(raw):
    with pytest.raises(ValueError, match="KVLENS_REQUEST_LOG_SAMPLE.*0 to 1"):
        settings(KVLENS_REQUEST_LOG="/tmp/x.jsonl", KVLENS_REQUEST_LOG_SAMPLE=raw)
    with pytest.raises(ValueError, match="0 to 1"):
        RequestLog("/unused", float("nan") if raw == "nan" else 2.0)


def test_rotation_is_the_event_logs(tmp_path):
    path = str(tmp_path / "requests.jsonl")
    line_len = len(json.dumps(record("cmpl-0-0"), separators=(",", ":"))) + 1
    log = RequestLog(path, max_bytes=line_len * 3, backups=2)
    for i in range(10):
        log.append(record(f"cmpl-{i}-0"))
    assert os.path.getsize(path) <= line_len * 3
    assert os.path.exists(path + ".2") and not os.path.exists(path + ".3")
    ids = [e["request_id"] for e in read_events(path)]
    assert ids == [f"cmpl-{i}-0" for i in range(10 - len(ids), 10)]


def test_an_odd_value_is_written_as_text_not_raised(tmp_path):
    log = RequestLog(str(tmp_path / "r.jsonl"))
    assert log.append(record(miss_detail={"path": tmp_path}))
    assert next(read_events(log.path))["miss_detail"] == {"path": str(tmp_path)}
