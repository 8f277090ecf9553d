"""Rescans of a disk tier's directory re-list only what changed, and still see every change."""

import hashlib
import os
import time

import pytest

from connector.tiers import disk as disk_files
from connector.tiers import disk_scan
from connector.tiers.disk import DiskTier
from connector.tiers.disk_scan import DirectoryScanner

PAYLOAD = memoryview(b"x" * 64)


def digest(i: int) -> str:
    return hashlib.blake2b(str(i).encode(), digest_size=16).hexdigest()


def fill(tier: DiskTier, count: int) -> list[str]:
    names = [digest(i) for i in range(count)]
    for name in names:
        tier.put(f"{name}.r0", PAYLOAD)
    return names


def age_directories(root: str, seconds: float = 3600) -> None:
    """Make every directory look last changed long ago (as after a quiet hour)."""
    old = time.time() - seconds
    for folder, _, _ in os.walk(root):
        os.utime(folder, (old, old))


def test_a_rescan_lists_only_the_subdirectory_that_changed(tmp_path):
    tier = DiskTier(str(tmp_path), "l")
    names = fill(tier, 300)
    scanner = DirectoryScanner(str(tmp_path), 1)
    age_directories(str(tmp_path))
    assert set(scanner.scan().added) == set(names)
    assert not scanner.scan()  # nothing changed: nothing listed
    listed, stated = scanner.cost.dirs_listed, scanner.cost.files_stated
    new = names[0][:3] + "0" * 29
    gone = next(n for n in names if n[:3] != new[:3])
    tier.put(f"{new}.r0", PAYLOAD)
    os.unlink(tier.path(f"{gone}.r0"))  # another engine deleted one
    delta = scanner.scan()
    assert set(delta.added) == {new} and delta.removed == {gone}
    assert scanner.cost.dirs_listed - listed == 2  # the two subdirectories, nothing else
    assert scanner.cost.files_stated - stated == 1  # files seen before (same inodes) are not read again


def test_a_rescan_checks_about_the_same_whatever_the_number_of_files(tmp_path):
    """Directories checked per rescan do not grow with the files (at most one per subdirectory)."""
    costs = []
    for count in (50, 1000):
        root = tmp_path / str(count)
        fill(DiskTier(str(root), "l"), count)
        scanner = DirectoryScanner(str(root), 1)
        age_directories(str(root))
        scanner.scan()
        before = scanner.cost.files_stated
        scanner.scan()
        costs.append(scanner.cost.files_stated - before)
    assert costs == [0, 0]


def test_a_load_elsewhere_is_seen_as_a_use_by_the_next_rescan(tmp_path):
    writer, reader = DiskTier(str(tmp_path), "l"), DiskTier(str(tmp_path), "l")
    (name,) = fill(writer, 1)
    path = writer.path(f"{name}.r0")
    os.utime(path, (100, 100))  # written long ago
    scanner = DirectoryScanner(str(tmp_path), 1)
    age_directories(str(tmp_path))
    scanner.scan()
    reader.touch(f"{name}.r0")  # another engine pins it for a load (as its watcher does)
    reader.mark_used(name)
    assert scanner.scan().used == {name}
    assert not scanner.scan()  # seen once


def test_use_marks_are_removed_once_every_engine_has_seen_them(tmp_path):
    tier = DiskTier(str(tmp_path), "l")
    (name,) = fill(tier, 1)
    tier.mark_used(name)
    mark = os.path.join(os.path.dirname(tier.path(f"{name}.r0")), disk_files.USE_MARK_PREFIX + name)
    DirectoryScanner(str(tmp_path), 1).scan()
    assert os.path.exists(mark)
    old = time.time() - disk_scan.USE_MARK_MAX_AGE_S - 1
    os.utime(mark, (old, old))
    DirectoryScanner(str(tmp_path), 1).scan()
    assert not os.path.exists(mark)


def test_a_change_within_the_same_directory_time_tick_is_not_missed(tmp_path):
    tier = DiskTier(str(tmp_path), "l")
    (first,) = fill(tier, 1)
    folder = os.path.dirname(tier.path(f"{first}.r0"))
    scanner = DirectoryScanner(str(tmp_path), 1)
    scanner.scan()
    tick = os.stat(folder).st_mtime_ns
    second = first[:3] + "0" * 29
    tier.put(f"{second}.r0", PAYLOAD)
    os.utime(folder, ns=(tick, tick))  # a coarse clock: the directory's time did not move
    assert set(scanner.scan().added) == {second}


def test_temp_files_of_dead_writers_are_swept_from_subdirectories(tmp_path):
    tier = DiskTier(str(tmp_path), "l")
    (name,) = fill(tier, 1)
    folder = os.path.dirname(tier.path(f"{name}.r0"))
    dead, live = os.path.join(folder, ".tmp-dead"), os.path.join(folder, ".tmp-live")
    for path in (dead, live):
        open(path, "wb").close()
    os.utime(dead, (1, 1))
    DirectoryScanner(str(tmp_path), 1).scan()
    assert os.path.exists(live) and not os.path.exists(dead)


def _write_flat(root, name: str, payload: memoryview = PAYLOAD) -> None:
    """A chunk file as versions before the subdirectories wrote it (directly in the root)."""
    source = DiskTier(str(root / "staging"), "l")
    source.put(f"{name}.r0", payload)
    os.rename(source.path(f"{name}.r0"), disk_files.legacy_path(str(root), f"{name}.r0"))


def test_a_flat_directory_of_an_older_version_is_moved_into_subdirectories(tmp_path):
    names = [digest(i) for i in range(20)]
    for name in names:
        _write_flat(tmp_path, name)
    first, second = DirectoryScanner(str(tmp_path), 1), DirectoryScanner(str(tmp_path), 1)
    assert set(first.scan().added) == set(names)
    assert set(second.scan().added) == set(names)  # a second engine of this version agrees
    assert not [n for n in os.listdir(tmp_path) if n.endswith(disk_files.SUFFIX)]
    tier = DiskTier(str(tmp_path), "l")
    assert all(bytes(tier.get(f"{n}.r0")) == bytes(PAYLOAD) for n in names)


def test_two_engines_moving_the_same_flat_directory_at_once_lose_nothing(tmp_path, monkeypatch):
    names = [digest(i) for i in range(20)]
    for name in names:
        _write_flat(tmp_path, name)
    other = DirectoryScanner(str(tmp_path), 1)
    real_rename = os.rename
    moved = []

    def race(src, dst):  # the other engine moves the first file while we are listing
        if not moved:
            moved.append(src)
            assert set(other.scan().added) == set(names)
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", race)
    mine = DirectoryScanner(str(tmp_path), 1)
    assert set(mine.scan().added) == set(names)


def test_a_flat_directory_that_cannot_be_changed_is_read_in_place(tmp_path, monkeypatch):
    names = [digest(i) for i in range(5)]
    for name in names:
        _write_flat(tmp_path, name)

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "rename", read_only)
    monkeypatch.setattr(os, "makedirs", read_only)
    scanner = DirectoryScanner(str(tmp_path), 1)
    assert set(scanner.scan().added) == set(names)
    monkeypatch.undo()
    tier = DiskTier(str(tmp_path), "l", grace_s=0)
    assert bytes(tier.get(f"{names[0]}.r0")) == bytes(PAYLOAD)
    assert tier.delete(f"{names[1]}.r0") is True
    assert names[1] in scanner.scan().removed


def test_a_removed_directory_empties_the_view(tmp_path):
    tier = DiskTier(str(tmp_path / "kv"), "l")
    names = fill(tier, 10)
    scanner = DirectoryScanner(str(tmp_path / "kv"), 1)
    scanner.scan()
    for path in disk_files.chunk_files(str(tmp_path / "kv")):
        os.unlink(path)
    for folder in sorted({os.path.dirname(tier.path(f"{n}.r0")) for n in names}):
        os.rmdir(folder)
    os.rmdir(tmp_path / "kv")
    assert scanner.scan().removed == set(names) and len(scanner) == 0


def test_a_scan_error_keeps_the_last_view_and_is_reported(tmp_path, monkeypatch):
    tier = DiskTier(str(tmp_path), "l")
    names = fill(tier, 3)
    scanner = DirectoryScanner(str(tmp_path), 1)
    scanner.scan()
    age_directories(str(tmp_path))

    def broken(path):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(disk_scan.os, "scandir", broken)
    os.unlink(tier.path(f"{names[0]}.r0"))
    delta = scanner.scan()
    assert not delta and isinstance(scanner.error, OSError) and len(scanner) == 3
    monkeypatch.undo()
    assert scanner.scan().removed == {names[0]} and scanner.error is None


@pytest.mark.parametrize("grace_s", [0.05])
def test_the_names_a_disk_tier_remembers_writing_stay_bounded(tmp_path, grace_s):
    """Names written and then deleted by another engine are not remembered for ever."""
    ours = DiskTier(str(tmp_path), "l", grace_s=grace_s)
    for name in fill(ours, 200):
        os.unlink(ours.path(f"{name}.r0"))  # another engine evicted it
    time.sleep(2 * grace_s)
    ours.put(f"{digest(999)}.r0", PAYLOAD)
    assert ours.recent_writes == 1


def test_delete_tells_removed_from_already_gone(tmp_path):
    first, second = DiskTier(str(tmp_path), "l", grace_s=0), DiskTier(str(tmp_path), "l", grace_s=0)
    first.put(f"{digest(1)}.r0", PAYLOAD)
    assert first.delete(f"{digest(1)}.r0") is True
    assert second.delete(f"{digest(1)}.r0") is None
