import os
from pathlib import Path

import pytest

from connector.tiers import codec
from connector.tiers import disk as disk_files
from connector.tiers.base import ChunkCorrupt, ChunkMissing, Tier
from connector.tiers.cpu import CpuTier
from connector.tiers.disk import DiskTier
from connector.tiers.disk_scan import DirectoryScanner

NAME = "ab" * 16 + ".r0"


@pytest.fixture(params=["cpu", "disk"])
def tier(request, tmp_path) -> Tier:
    return CpuTier() if request.param == "cpu" else DiskTier(str(tmp_path), "layout-1")


def test_tier_contract_roundtrip_delete_clear(tier):
    assert isinstance(tier, Tier)
    payload = memoryview(bytearray(os.urandom(4096)))
    tier.put(NAME, payload)
    got = tier.get(NAME)
    assert bytes(got) == bytes(payload) and not got.readonly
    tier.delete(NAME)
    tier.delete(NAME)  # deleting twice is fine
    with pytest.raises(ChunkMissing):
        tier.get(NAME)
    tier.put(NAME, payload)
    tier.clear()
    with pytest.raises(ChunkMissing):
        tier.get(NAME)


def _record_path(tmp_path, name=NAME):
    return Path(disk_files.chunk_path(str(tmp_path), name))


@pytest.mark.parametrize("damage", ["truncate", "flip", "header", "empty"])
def test_damaged_disk_records_are_rejected(tmp_path, damage):
    t = DiskTier(str(tmp_path), "layout-1")
    t.put(NAME, memoryview(bytearray(os.urandom(4096))))
    path = _record_path(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:-100]
    elif damage == "flip":
        data[-1] ^= 0xFF
    elif damage == "header":
        data[10] ^= 0xFF
    else:
        data = bytearray()
    path.write_bytes(data)
    with pytest.raises(ChunkCorrupt):
        t.get(NAME)


def test_record_for_another_layout_or_name_is_rejected(tmp_path):
    DiskTier(str(tmp_path), "layout-1").put(NAME, memoryview(b"x" * 64))
    with pytest.raises(ChunkCorrupt):
        DiskTier(str(tmp_path), "layout-2", remove_corrupt=False).get(NAME)
    other = "cd" * 16 + ".r0"
    os.makedirs(_record_path(tmp_path, other).parent)
    os.rename(_record_path(tmp_path), _record_path(tmp_path, other))
    with pytest.raises(ChunkCorrupt):
        DiskTier(str(tmp_path), "layout-1").get(other)


def test_failed_write_leaves_no_readable_chunk(tmp_path, monkeypatch):
    t = DiskTier(str(tmp_path), "layout-1")

    def boom(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        t.put(NAME, memoryview(b"x" * 64))
    monkeypatch.undo()
    assert [f for _, _, files in os.walk(tmp_path) for f in files] == []
    with pytest.raises(ChunkMissing):
        t.get(NAME)


def test_scan_sees_complete_chunks_only(tmp_path):
    t = DiskTier(str(tmp_path), "layout-1")
    a, b = "aa" * 16, "bb" * 16
    for rank in (0, 1):
        t.put(f"{a}.r{rank}", memoryview(b"x" * 64))
    t.put(f"{b}.r0", memoryview(b"x" * 64))
    (tmp_path / ".tmp-half-written").write_bytes(b"junk")
    (_record_path(tmp_path, a).parent / ".tmp-half-written").write_bytes(b"junk")
    found = DirectoryScanner(str(tmp_path), world_size=2).scan().added
    assert list(found) == [a] and found[a].nbytes > 64


def test_sweep_removes_only_old_temp_files(tmp_path):
    old, new = tmp_path / ".tmp-old", tmp_path / ".tmp-new"
    old.write_bytes(b"x")
    new.write_bytes(b"x")
    os.utime(old, (1, 1))
    assert disk_files.sweep_temp_files(str(tmp_path)) == 1
    assert new.exists() and not old.exists()


def test_codec_detects_every_single_byte_change():
    payload = memoryview(bytearray(range(256)))
    record = bytearray(codec.encode_header("n", "l", payload)) + bytes(payload)
    assert bytes(codec.decode(record, "n", "l")) == bytes(payload)
    for i in range(len(record)):
        broken = bytearray(record)
        broken[i] ^= 0x01
        with pytest.raises(ChunkCorrupt):
            codec.decode(broken, "n", "l")


def test_disk_tier_recreates_a_removed_directory(tmp_path):
    root = tmp_path / "kv"
    t = DiskTier(str(root), "layout-1")
    root.rmdir()
    t.put(NAME, memoryview(b"x" * 64))
    assert bytes(t.get(NAME)) == b"x" * 64


def test_a_corrupt_record_is_removed_when_read_but_a_fresh_copy_is_not(tmp_path, monkeypatch):
    t = DiskTier(str(tmp_path), "layout-1")
    t.put(NAME, memoryview(b"x" * 64))
    path = _record_path(tmp_path)
    path.write_bytes(path.read_bytes()[:-1] + b"!")
    with pytest.raises(ChunkCorrupt):
        t.get(NAME)
    assert not path.exists()  # no rescan can bring it back
    t.put(NAME, memoryview(b"x" * 64))
    real_decode = codec.decode

    def corrupt_then_rewritten(record, name, layout, *trust):
        t.put(NAME, memoryview(b"y" * 64))  # another engine replaces it while we read
        return real_decode(b"junk", name, layout)

    monkeypatch.setattr(codec, "decode", corrupt_then_rewritten)
    with pytest.raises(ChunkCorrupt):
        t.get(NAME)
    monkeypatch.undo()
    assert bytes(t.get(NAME)) == b"y" * 64


def test_a_chunk_another_engine_is_about_to_load_is_not_deleted(tmp_path):
    t = DiskTier(str(tmp_path), "layout-1", grace_s=30.0)
    t.put(NAME, memoryview(b"x" * 64))
    t.get(NAME)  # reading it (relatime) does not mark it in use
    assert t.delete(NAME) is True and not _record_path(tmp_path).exists()
    t.put(NAME, memoryview(b"x" * 64))
    os.utime(
        _record_path(tmp_path), ns=(os.stat(_record_path(tmp_path)).st_mtime_ns, 10**9)
    )  # written long ago
    t.touch(NAME)  # a lookup on another engine pinned it
    assert t.delete(NAME) is False and _record_path(tmp_path).exists()
    assert DirectoryScanner(str(tmp_path), 1).scan().added[NAME.split(".")[0]].used_ns > 0
    assert DiskTier(str(tmp_path), "layout-1", grace_s=0).delete(NAME) is True


def test_probe_writes_reads_and_cleans_up(tmp_path):
    t = DiskTier(str(tmp_path), "layout-1")
    t.probe()
    assert [f for _, _, files in os.walk(tmp_path) for f in files] == []


def test_a_chunk_another_engine_wrote_recently_is_not_deleted_but_our_own_is(tmp_path):
    ours, theirs = DiskTier(str(tmp_path), "layout-1"), DiskTier(str(tmp_path), "layout-1")
    theirs.put(NAME, memoryview(b"x" * 64))
    assert ours.delete(NAME) is False and _record_path(tmp_path).exists()
    assert theirs.delete(NAME) is True and not _record_path(tmp_path).exists()


def test_a_lookup_that_times_out_once_costs_a_miss_not_the_whole_remote_tier():
    from connector.scheduler.remote_lookup import RemoteLookup
    from connector.tiers.redis_tier import RemoteUnavailable

    class BusyRedis:
        calls = 0

        def exists_many(self, keys):
            BusyRedis.calls += 1
            if BusyRedis.calls <= 1 or BusyRedis.calls >= 3:
                raise RemoteUnavailable("exists_many timed out", op="exists_many", kind="timeout")
            return [True] * len(keys)

        def connect(self):
            return 0.001

        def close(self):
            pass

    lookup = RemoteLookup(BusyRedis(), world_size=1, keepalive_s=None)
    assert lookup.present("a", ["x"]).present == [False]  # a miss for this request
    assert lookup.usable()  # the next lookup still asks
    assert lookup.present("b", ["x"]).present == [True]
    for rid in ("c", "d", "e"):  # timeouts in a row: now the tier is skipped
        lookup.present(rid, ["x"])
    assert not lookup.health.usable()


def test_reading_a_record_never_marks_it_used_however_late_the_writer_ran(tmp_path, monkeypatch):
    """The writer's clock read can lag the kernel's stamps (a tick, a process descheduled between
    the two): the first read must still leave the access time alone on a relatime mount."""
    import time as real_time

    from connector.tiers import disk as disk_module

    lagging = type("Clock", (), {"time_ns": staticmethod(lambda: real_time.time_ns() - 50_000_000)})
    monkeypatch.setattr(disk_module, "time", lagging)
    t = DiskTier(str(tmp_path), "layout-1", grace_s=30.0)
    t.put(NAME, memoryview(b"x" * 64))
    real_time.sleep(0.01)  # later than a tick
    t.get(NAME)
    st = os.stat(_record_path(tmp_path))
    assert st.st_atime_ns == st.st_mtime_ns + disk_module.WRITE_MARK_NS  # as written: the read left it
    monkeypatch.undo()
    assert t.delete(NAME) is True
