"""Keeps the scheduler's disk-tier index in step with a directory other engines share.

Ownership of a shared directory (every engine pointed at it agrees, with no coordinator):
- The budget (``max_local_disk_size``) is the directory's, not each engine's: every engine
  indexes every chunk file it finds and evicts, least recently used first, to keep the
  directory within it. Recency is shared through the files' times: a write sets the
  modification time, a lookup that pins a chunk for a load sets its access time.
- A file used for a load within ``disk_shared_grace_s`` is never deleted (the worker checks
  right before deleting), because another engine may be about to load it; the evicting
  engine learns the file was kept and counts it again.
- A consumer (``kv_consumer``) never deletes anything.

A daemon thread rescans the directory every ``disk_scan_interval_s`` and hands the scheduler
only what changed since its last scan (``ScanDelta``), and it applies the access-time
touches, so neither the rescan nor any file system call runs on the step loop. Chunks this
engine admitted or evicted recently are left alone by a merge: the scan may predate the
write or the delete.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from .engine.index import TierIndex
from .engine.keys import storage_name
from .tiers import disk as disk_files
from .tiers.disk import DiskTier, FileInfo

logger = logging.getLogger("vllm.kvlens")

_SETTLE_S = 10.0  # a local change this much older than a scan is visible in it (writes may lag)


@dataclass(slots=True)
class ScanDelta:
    started: float  # wall-clock time the scan began
    added: dict[str, FileInfo] = field(default_factory=dict)  # new or rewritten chunk files
    removed: set[str] = field(default_factory=set)
    used: set[str] = field(default_factory=set)  # loaded by some engine since the last scan


def diff(before: dict[str, FileInfo], after: dict[str, FileInfo], started: float) -> ScanDelta:
    delta = ScanDelta(started)
    for name, info in after.items():
        old = before.get(name)
        if old is None or old.mtime_ns != info.mtime_ns:
            delta.added[name] = info
        elif info.used_ns > old.used_ns:
            delta.used.add(name)
    delta.removed = {name for name in before if name not in after}
    return delta


class DiskWatcher:
    """Rescans the directory and applies access-time touches, in a daemon thread."""

    def __init__(self, disk: DiskTier, world_size: int, interval_s: float) -> None:
        self._disk, self._world, self._interval = disk, world_size, interval_s
        started = time.time()
        self._last = disk_files.scan(disk.root, world_size)
        self._deltas: deque[ScanDelta] = deque([diff({}, self._last, started)])
        self._touches: deque[str] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._scan_failing = False
        self._thread = threading.Thread(target=self._run, name="kvlens-disk-scan", daemon=True)
        self._thread.start()

    def touch(self, names: Iterable[str]) -> None:
        self._touches.extend(names)
        self._wake.set()

    def take(self) -> list[ScanDelta]:
        out = []
        while self._deltas:
            out.append(self._deltas.popleft())
        return out

    def _run(self) -> None:
        next_scan = time.monotonic() + self._interval
        while not self._stop.is_set():
            self._wake.wait(max(next_scan - time.monotonic(), 0.0))
            self._wake.clear()
            self._apply_touches()
            if time.monotonic() >= next_scan and not self._stop.is_set():
                self._scan()
                next_scan = time.monotonic() + self._interval

    def _apply_touches(self) -> None:
        while self._touches:
            digest = self._touches.popleft()
            for rank in range(self._world):
                try:
                    self._disk.touch(storage_name(digest, rank))
                except OSError as e:
                    logger.debug("KVLens: touching %s failed: %s", digest[:12], e)

    def _scan(self) -> None:
        started = time.time()
        try:
            now = disk_files.scan(self._disk.root, self._world)
        except OSError as e:  # keep serving from the last good view; say so once
            if not self._scan_failing:
                logger.warning("KVLens: disk scans of %s fail: %s", self._disk.root, e)
            self._scan_failing = True
            return
        if self._scan_failing:
            logger.info("KVLens: disk scans of %s work again", self._disk.root)
            self._scan_failing = False
        delta = diff(self._last, now, started)
        self._last = now
        if delta.added or delta.removed or delta.used:
            self._deltas.append(delta)

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)


class SharedDiskView:
    """The scheduler's side: merges scan deltas into the disk index, on the scheduler thread."""

    def __init__(self, index: TierIndex, watcher: DiskWatcher, evicts: bool, grace_s: float) -> None:
        self._index = index
        self._watcher = watcher
        self._evicts = evicts
        self._touch_every_ns = int(grace_s * 1e9 / 4)
        self._changed: dict[str, float] = {}  # digest -> when this engine admitted/evicted it
        self._touched_ns: dict[str, int] = {}

    def note_changed(self, names: Iterable[str]) -> None:
        now = time.time()
        for name in names:
            self._changed[name] = now

    def pinned_for_load(self, names: Iterable[str]) -> None:
        """Tell other engines these chunks are about to be loaded (at most every grace/4)."""
        now = time.time_ns()
        due = [n for n in names if now - self._touched_ns.get(n, 0) >= self._touch_every_ns]
        if due:
            for n in due:
                self._touched_ns[n] = now
            self._watcher.touch(due)
            if len(self._touched_ns) > 4 * max(len(self._index), 1024):
                self._touched_ns = {n: t for n, t in self._touched_ns.items() if n in self._index}

    def merge(self) -> list[str]:
        """Apply the scans that arrived; returns chunks to evict to keep the directory in budget."""
        deltas = self._watcher.take()
        if not deltas:
            return []
        index = self._index
        for delta in deltas:
            settle = delta.started - _SETTLE_S
            if self._changed:
                self._changed = {k: t for k, t in self._changed.items() if t >= settle - 60.0}
            for name in delta.removed:
                if self._changed.get(name, 0) < settle:
                    index.remove(name)  # deleted by another engine
            fresh = [
                (name, info)
                for name, info in delta.added.items()
                if name not in index and self._changed.get(name, 0) < settle
            ]
            fresh.sort(key=lambda kv: kv[1].last_used_ns)
            recent_ns = (delta.started - 2 * _SETTLE_S) * 1e9
            for name, info in reversed(fresh):  # older files in front of the LRU order, oldest first
                if info.last_used_ns < recent_ns:
                    index.add_known(name, info.nbytes, most_recent=False)
            for name, info in fresh:  # files used lately behind this engine's own, newest last
                if info.last_used_ns >= recent_ns:
                    index.add_known(name, info.nbytes, most_recent=True)
            for name in delta.used:
                index.touch(name)
        if not self._evicts:
            return []
        victims = index.overflow_victims()
        self.note_changed(victims)
        return victims

    def stop(self) -> None:
        self._watcher.stop()
