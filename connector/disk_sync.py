"""Keeps the scheduler's disk-tier index in step with a directory other engines write too.

A background thread rescans the directory; the scheduler thread merges the newest scan when
it next looks up or plans, so the index is only ever touched by one thread. Chunks this engine
admitted or evicted recently are left alone by a merge: the scan may predate the write or
the delete.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

from .engine.index import TierIndex
from .tiers import disk as disk_files

logger = logging.getLogger("vllm.kvlens")

_SETTLE_S = 10.0  # a local change this much older than a scan is visible in it (writes may lag)
_FORGET_S = 60.0


class DiskWatcher:
    """Rescans the directory every ``interval_s`` seconds in a daemon thread."""

    def __init__(self, root: str, world_size: int, interval_s: float) -> None:
        self._root, self._world, self._interval = root, world_size, interval_s
        self.latest: tuple[float, dict[str, int]] | None = (time.time(), disk_files.scan(root, world_size))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvlens-disk-scan", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            started = time.time()
            try:
                self.latest = (started, disk_files.scan(self._root, self._world))
            except OSError as e:  # keep serving from the last good view
                logger.warning("KVLens: disk scan of %s failed: %s", self._root, e)

    def take(self) -> tuple[float, dict[str, int]] | None:
        latest, self.latest = self.latest, None
        return latest

    def stop(self) -> None:
        self._stop.set()


class SharedDiskView:
    def __init__(self, index: TierIndex, watcher: DiskWatcher) -> None:
        self._index = index
        self._watcher = watcher
        self._changed: dict[str, float] = {}  # digest -> when this engine admitted/evicted it

    def note_changed(self, names: Iterable[str]) -> None:
        now = time.time()
        for name in names:
            self._changed[name] = now

    def merge(self) -> list[str]:
        """Apply the newest scan, if any; returns chunks to evict to stay within the budget."""
        latest = self._watcher.take()
        if latest is None:
            return []
        started, on_disk = latest
        settle = started - _SETTLE_S
        self._changed = {k: t for k, t in self._changed.items() if t > started - _FORGET_S}
        index = self._index
        for name in index.keys():
            if name not in on_disk and self._changed.get(name, 0) < settle:
                index.remove(name)  # deleted by another engine
        for name, nbytes in on_disk.items():
            if name not in index and self._changed.get(name, 0) < settle:
                index.add_known(name, nbytes)
        victims = index.overflow_victims()
        self.note_changed(victims)
        return victims

    def stop(self) -> None:
        self._watcher.stop()
