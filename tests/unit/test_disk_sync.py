import os
import time

from connector.engine.index import TierIndex
from connector.scheduler.disk_sync import DiskWatcher, ScanDelta, SharedDiskView, diff
from connector.tiers.disk import NEVER_USED_NS, DiskTier, FileInfo


class DeltaFeed:
    """Stands in for the background watcher: hands over deltas the test makes, and answers for
    the directory as the newest of them left it."""

    def __init__(self) -> None:
        self.deltas: list[ScanDelta] = []
        self.touched: list[str] = []
        self.files: dict[str, FileInfo] = {}
        self.last_scan_started = 0.0

    def give(self, added=(), removed=(), used=(), age_s: float = -20.0, nbytes=100, last_used_s=None):
        """A scan that started ``age_s`` ago (by default well after any local change settled)."""
        started = time.time() - age_s
        t = int((last_used_s if last_used_s is not None else time.time()) * 1e9)
        delta = ScanDelta(
            started, {n: FileInfo(nbytes, t, NEVER_USED_NS) for n in added}, set(removed), set(used)
        )
        self.deltas.append(delta)
        self.files.update(delta.added)
        for name in removed:
            self.files.pop(name, None)
        self.last_scan_started = started

    def take(self, max_changes=None):
        out = []
        while self.deltas and (max_changes is None or sum(len(d) for d in out) < max_changes):
            out.append(self.deltas.pop(0))
        return out

    def holds(self, name):
        return self.files.get(name)

    def touch(self, names):
        self.touched.extend(names)

    def stop(self) -> None:
        pass


def view(index, feed, evicts=True):
    return SharedDiskView(index, feed, evicts, grace_s=30.0)


def test_chunks_written_or_deleted_by_other_engines_enter_and_leave_the_index():
    index, feed = TierIndex("disk", 1000), DeltaFeed()
    v = view(index, feed)
    index.admit("ours", 100)
    feed.give(added=["theirs"])
    assert v.merge().evict == [] and "theirs" in index
    feed.give(removed=["ours"])  # another engine deleted ours
    assert v.merge().gone == ["ours"]
    assert "ours" not in index and "theirs" in index


def test_recent_local_changes_are_not_undone_by_an_older_scan():
    index, feed = TierIndex("disk", 1000), DeltaFeed()
    v = view(index, feed)
    index.admit("just-stored", 100)
    v.note_changed(["just-stored", "just-evicted"])
    feed.give(added=["just-evicted"], removed=["just-stored"], age_s=0.0)  # ran before our writes landed
    v.merge()
    assert "just-stored" in index and "just-evicted" not in index


def test_what_a_scan_saw_while_our_change_settled_is_checked_again_once_it_has():
    """Another engine deleted a chunk we had just stored (and wrote one we had just evicted):
    the scan that saw it came too early to trust, a later one is believed."""
    index, feed = TierIndex("disk", 1000), DeltaFeed()
    v = view(index, feed)
    index.admit("ours-then-deleted", 100)
    v.note_changed(["ours-then-deleted", "evicted-then-rewritten"])
    feed.give(added=["evicted-then-rewritten"], removed=["ours-then-deleted"], age_s=0.0)
    v.merge()
    assert "ours-then-deleted" in index and "evicted-then-rewritten" not in index
    feed.last_scan_started = time.time() + 20  # a later scan; nothing changed since
    assert v.merge().gone == ["ours-then-deleted"]
    assert "ours-then-deleted" not in index and "evicted-then-rewritten" in index


def test_the_directory_budget_evicts_the_least_recently_used_first():
    index, feed = TierIndex("disk", 250), DeltaFeed()
    v = view(index, feed)
    feed.give(added=["old"], last_used_s=time.time() - 3600)
    v.merge()
    index.admit("mine", 100)
    feed.give(added=["new"])  # another engine's fresh chunk is not the first to go
    assert v.merge().evict == ["old"]
    assert "new" in index and "mine" in index


def test_indexing_a_big_directory_is_spread_over_steps_and_keeps_the_lru_order(monkeypatch):
    import connector.scheduler.disk_sync as disk_sync

    monkeypatch.setattr(disk_sync, "MERGE_PER_STEP", 8)
    index, feed = TierIndex("disk", 10**6), DeltaFeed()
    v = view(index, feed)
    old = time.time() - 3600
    files = {f"c{i:02d}": FileInfo(100, int((old + i) * 1e9), NEVER_USED_NS) for i in range(20)}
    feed.deltas.extend(ScanDelta(time.time() + 20, dict(files)).pieces(8))
    v.merge()
    assert len(index) == 8 and "c19" in index  # the most recently used first
    while feed.deltas:
        v.merge()
    assert index.keys() == sorted(files)  # least recently used in front


def test_a_consumer_mirrors_the_directory_but_never_evicts():
    index, feed = TierIndex("disk", 150), DeltaFeed()
    v = view(index, feed, evicts=False)
    feed.give(added=["a", "b"])
    assert v.merge().evict == [] and len(index) == 2


def test_chunks_used_by_other_engines_move_to_the_recent_end():
    index, feed = TierIndex("disk", 250), DeltaFeed()
    v = view(index, feed)
    index.admit("a", 100)
    index.admit("b", 100)
    feed.give(used=["a"])
    v.merge()
    assert index.admit("c", 100) == ["b"]


def test_pins_for_loads_touch_each_file_at_most_once_per_quarter_grace():
    index, feed = TierIndex("disk", 1000), DeltaFeed()
    v = view(index, feed)
    v.pinned_for_load(["a", "b"])
    v.pinned_for_load(["a"])
    assert feed.touched == ["a", "b"]


def test_scan_diffs_report_new_rewritten_removed_and_used_files():
    t = 10**18
    before = {"a": FileInfo(1, t, NEVER_USED_NS), "b": FileInfo(1, t, NEVER_USED_NS), "c": FileInfo(1, t, 5)}
    after = {
        "a": FileInfo(1, t + 1, NEVER_USED_NS),
        "c": FileInfo(1, t, 9),
        "d": FileInfo(1, t, NEVER_USED_NS),
    }
    d = diff(before, after, 0.0)
    assert set(d.added) == {"a", "d"} and d.removed == {"b"} and d.used == {"c"}


def test_watcher_sees_records_written_by_another_process_and_touches_files(tmp_path):
    disk = DiskTier(str(tmp_path), "l")
    name = "ab" * 16
    disk.put(name + ".r0", memoryview(b"x" * 10))
    watcher = DiskWatcher(disk, world_size=1, interval_s=3600)  # about the touch path, not rescans
    try:
        (delta,) = watcher.take()
        assert list(delta.added) == [name] and delta.started <= time.time()
        assert watcher.take() == []
        watcher.touch([name])
        deadline = time.time() + 5
        path = disk.path(name + ".r0")
        while os.stat(path).st_atime_ns <= os.stat(path).st_mtime_ns and time.time() < deadline:
            time.sleep(0.02)
        assert os.stat(path).st_atime_ns > os.stat(path).st_mtime_ns  # marked in use
    finally:
        watcher.stop()


# ---- a shared directory is counted once -------------------------------------------------------
def test_only_the_engine_whose_delete_removed_a_chunk_file_reports_it(tmp_path):
    from connector.engine.health import TierHealth
    from connector.tiers.background import BackgroundTier

    name = "ab" * 16 + ".r0"
    DiskTier(str(tmp_path), "l").put(name, memoryview(b"x" * 10))
    engines = [
        BackgroundTier(DiskTier(str(tmp_path), "l", grace_s=0), TierHealth("disk"), 5.0, 1 << 20)
        for _ in range(2)
    ]
    try:
        for tier in engines:  # both decided to evict it
            tier.delete(name)
            tier.drain(5.0)
        assert [tier.take_deleted() for tier in engines] == [[name], []]
    finally:
        for tier in engines:
            tier.close(1.0)


def test_disk_evictions_count_deletes_that_removed_the_file_not_decisions(tmp_path):
    from connector.engine.jobs import DISK
    from connector.engine.outcomes import FailureReason, WorkerReport

    from .fakes import BLOCK_BYTES, LAYERS, admit_fully, blocks, gb, request, scheduler

    chunk = 2 * BLOCK_BYTES * LAYERS
    s = scheduler(local_cpu=False, local_disk=str(tmp_path), max_local_disk_size=gb(2 * chunk))
    admit_fully(s, request("a", list(range(600))), blocks(0, 5))
    _, plan = admit_fully(s, request("b", list(range(5000, 5600))), blocks(10, 5))
    evicted = [e.name for e in plan.evictions]
    assert len(evicted) == 2
    assert s.take_evictions().get(DISK, 0) == 0  # decided, not done: another engine may delete first
    s.on_worker_report(WorkerReport(deleted=[(DISK, evicted[0])]))  # the other one was gone already
    assert s.take_evictions() == {DISK: 1}
    s.state.forget(DISK, plan.stores[0].name, FailureReason.IO_ERROR)
    s.on_worker_report(WorkerReport(deleted=[(DISK, plan.stores[0].name)]))
    assert s.take_evictions().get(DISK, 0) == 0  # a failed chunk deleted is not an eviction


def test_disk_gauges_name_the_shared_directory_so_engines_sharing_it_count_once(tmp_path):
    from connector.scheduler.instance_info import disk_identity

    from .fakes import scheduler

    first = scheduler(local_disk=str(tmp_path), max_local_disk_size=1)
    second = scheduler(local_disk=str(tmp_path / "." / ""), max_local_disk_size=1)
    try:
        where = disk_identity(str(tmp_path))
        for s in (first, second):
            tiers = {t.tier: t for t in s.sizes().tiers}
            assert (tiers["disk"].storage, tiers["disk"].capacity_bytes) == (where, 1024**3)
            assert tiers["cpu"].storage == ""  # this engine's own memory: no store named
    finally:
        first.shutdown()
        second.shutdown()
