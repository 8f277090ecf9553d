import time

from connector.disk_sync import DiskWatcher, SharedDiskView
from connector.engine.index import TierIndex
from connector.tiers.disk import DiskTier


class ScanFeed:
    """Stands in for the background watcher: hands over scans the test makes."""

    def __init__(self) -> None:
        self.latest = None

    def give(self, scan: dict[str, int], age_s: float = 5.0) -> None:
        self.latest = (time.time() + age_s, scan)

    def take(self):
        latest, self.latest = self.latest, None
        return latest

    def stop(self) -> None:
        pass


def test_chunks_written_or_deleted_by_other_engines_enter_and_leave_the_index():
    index, feed = TierIndex("disk", 1000), ScanFeed()
    view = SharedDiskView(index, feed)
    index.admit("ours", 100)
    feed.give({"ours": 100, "theirs": 100})
    assert view.merge() == [] and "theirs" in index
    feed.give({"theirs": 100})  # another engine deleted ours
    view.merge()
    assert "ours" not in index and "theirs" in index


def test_recent_local_changes_are_not_undone_by_an_older_scan():
    index, feed = TierIndex("disk", 1000), ScanFeed()
    view = SharedDiskView(index, feed)
    index.admit("just-stored", 100)
    view.note_changed(["just-stored", "just-evicted"])
    feed.give({"just-evicted": 100}, age_s=0.0)  # the scan ran before our store and our delete landed
    view.merge()
    assert "just-stored" in index and "just-evicted" not in index


def test_scanned_chunks_beyond_the_budget_are_evicted_oldest_first():
    index, feed = TierIndex("disk", 250), ScanFeed()
    view = SharedDiskView(index, feed)
    index.admit("mine", 100)
    feed.give({"mine": 100, "a": 100, "b": 100})
    victims = view.merge()
    assert len(victims) == 1 and victims[0] in ("a", "b") and index.used_bytes == 200


def test_watcher_sees_complete_records_written_by_another_process(tmp_path):
    DiskTier(str(tmp_path), "l").put("ab" * 16 + ".r0", memoryview(b"x" * 10))
    watcher = DiskWatcher(str(tmp_path), world_size=1, interval_s=3600)
    try:
        started, scan = watcher.take()
        assert list(scan) == ["ab" * 16] and started <= time.time()
        assert watcher.take() is None
    finally:
        watcher.stop()
