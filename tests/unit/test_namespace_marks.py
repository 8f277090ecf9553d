"""First-chunk marks: another instance that shares the disk directory (or Redis) explains its
miss of a prompt stored under another namespace by what differs, never by a salt or a tag."""

import time

from connector.engine.keys import Namespace, first_chunk_fingerprint, key_fingerprint
from connector.engine.namespace_marks import (
    BUCKETS,
    MAX_BUCKET_BYTES,
    PER_BUCKET,
    MarkView,
    decode,
    encode,
    merge,
    record_differences,
)
from connector.engine.namespace_records import NamespaceRecord
from connector.engine.outcomes import MissReason
from connector.tiers.store_records import DiskRecords

from .test_admin import PROMPT, Worker, _hashed, _scheduler, _store

BASE = Namespace("m", "bfloat16", "L")


def _fp(i: int) -> bytes:
    return first_chunk_fingerprint(list(range(i, i + 256)), 256)


def test_buckets_round_trip_and_stay_bounded():
    entries = [(_fp(i)[:8], f"{i:012x}") for i in range(PER_BUCKET + 10)]
    merged = merge([], entries)
    assert len(merged) == PER_BUCKET and merged[-1] == entries[-1] and entries[0] not in merged
    raw = encode(merged)
    assert len(raw) <= MAX_BUCKET_BYTES and decode(raw) == merged
    again = merge(merged, [merged[0]])  # seen again: most recent, not twice
    assert again[-1] == merged[0] and len(again) == PER_BUCKET
    for bad in (b"", b"junk", raw[:-1], raw + b"x" * MAX_BUCKET_BYTES, None):
        assert decode(bad) == []


def test_differences_name_parts_never_values():
    salted = NamespaceRecord.of(Namespace("m", "bfloat16", "L", cache_salt="tenant-x"))
    tagged = NamespaceRecord.of(Namespace("m", "bfloat16", "L", tags=(("team", "blue"),)))
    other_model = NamespaceRecord.of(Namespace("tuned", "bfloat16", "L"))
    assert record_differences(BASE, salted) == ["cache_salt"]
    assert record_differences(Namespace("m", "bfloat16", "L", cache_salt="y"), salted) == ["cache_salt"]
    assert record_differences(Namespace("m", "bfloat16", "L", tags=(("team", "red"),)), tagged) == ["tags"]
    assert record_differences(BASE, tagged) == ["tags"]
    assert record_differences(BASE, other_model) == ["model"]


def test_the_view_finds_the_latest_other_namespace_that_stored_a_prompt():
    mine, salted = BASE, Namespace("m", "bfloat16", "L", cache_salt="x")
    records = {key_fingerprint(n): NamespaceRecord.of(n) for n in (mine, salted)}
    view = MarkView()
    assert not view.others_than(key_fingerprint(mine))
    unknown = "0123456789ab"  # no record found for it: not an explanation
    view.replace(
        [(_fp(1)[:8], key_fingerprint(salted)), (_fp(1)[:8], key_fingerprint(mine)), (_fp(2)[:8], unknown)],
        records,
    )
    assert view.others_than(key_fingerprint(mine))
    assert view.other(_fp(1), mine) == records[key_fingerprint(salted)]
    assert view.other(_fp(2), mine) is None and view.other(_fp(3), mine) is None
    assert view.other(_fp(1), salted) == records[key_fingerprint(mine)]


def _wait(predicate, what):
    deadline = time.monotonic() + 15
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_an_instance_sharing_the_disk_explains_a_miss_of_a_prompt_another_stored(tmp_path):
    a = _scheduler(tmp_path)
    _store(a, Worker(a), "a", cache_salt="tenant-x-secret")
    a.shutdown()  # writes the marks still queued
    b = _scheduler(tmp_path)  # another engine on the same directory, started after
    try:
        _wait(lambda: len(b.state.shared_marks.view) > 0, "marks read at start")
        req = _hashed("b", PROMPT, cache_salt="tenant-y-secret")
        assert b.lookup(req, 0) == 0
        result = b.state.lookups["b"]
        assert result.miss_reason is MissReason.OTHER_NAMESPACE
        assert result.miss_detail == {"differs_in": ["cache_salt"]}
        plain = _hashed("c", list(range(3000, 3600)))  # stored by no one
        b.lookup(plain, 0)
        assert b.state.lookups["c"].miss_reason is MissReason.NOT_STORED
    finally:
        b.shutdown()
    raw = b"".join(p.read_bytes() for p in (tmp_path / "disk").rglob("*") if p.is_file())
    assert (
        b"secret" not in raw
        and len(list((tmp_path / "disk" / ".kvlens-namespaces" / "marks").iterdir())) <= BUCKETS
    )
    assert DiskRecords(str(tmp_path / "disk")).namespaces()[1] == []  # marks are not taken for records


def test_a_mark_explains_only_while_its_namespace_record_is_there(tmp_path, monkeypatch):
    import connector.scheduler.shared_marks as shared
    from connector.engine.namespace_marks import bucket_of, mark_of

    monkeypatch.setattr(shared, "READ_S", 0.05)
    store = DiskRecords(str(tmp_path))
    salted = Namespace("m", "bfloat16", "L", cache_salt="x")
    fp = key_fingerprint(salted)
    marks = tmp_path / ".kvlens-namespaces" / "marks"
    marks.mkdir(parents=True)
    (marks / f"{bucket_of(mark_of(_fp(1))):02x}").write_bytes(encode([(mark_of(_fp(1)), fp)]))
    view = shared.SharedMarks(lambda: {"disk": store}, lambda: None)
    try:
        time.sleep(0.3)
        assert view.view.other(_fp(1), BASE) is None  # no record: no explanation
        store.write_namespace(NamespaceRecord.of(salted))
        view.wanted()
        _wait(lambda: view.view.other(_fp(1), BASE) is not None, "record read")
        assert record_differences(BASE, view.view.other(_fp(1), BASE)) == ["cache_salt"]
        store.remove_namespaces([fp])  # kvlens clear took the namespace: its marks explain nothing
        view.wanted()
        _wait(lambda: view.view.other(_fp(1), BASE) is None, "record gone")
    finally:
        view.close()
