"""Keeps the scheduler's disk-tier index in step with a directory other engines share.

Ownership of a shared directory (every engine pointed at it agrees, with no coordinator):
- The budget (``max_local_disk_size``) is the directory's, not each engine's: every engine
  indexes every chunk file it finds and evicts, least recently used first, to keep the
  directory within it. Recency is shared through the files' times: a write sets the
  modification time, a lookup that pins a chunk for a load sets its access time (and replaces
  the chunk's use mark in its subdirectory, so that the other engines' next rescan lists it).
- A file used for a load within ``disk_shared_grace_s`` is never deleted (the worker checks
  right before deleting), because another engine may be about to load it; the evicting
  engine learns the file was kept and counts it again.
- A consumer (``kv_consumer``) never deletes anything.

A daemon thread rescans the directory every ``disk_scan_interval_s`` and hands the scheduler
only what changed since its last scan (``ScanDelta``), and it applies the access-time
touches, so neither the rescan nor any file system call runs on the step loop. A rescan
re-lists only the subdirectories whose time moved (``tiers/disk_scan.py``), so it costs about
the same for ten thousand chunk files as for a million; the first one lists everything, and
the engine waits for it up to ``STARTUP_WAIT_S`` (then it goes on in the background, and
lookups miss the disk until it is done). Chunks this engine admitted or evicted recently are
left alone by a merge: the scan may predate the write or the delete.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from ..engine.index import TierIndex
from ..engine.keys import storage_name
from ..tiers.disk import DiskTier, FileInfo
from ..tiers.disk_scan import DirectoryScanner, ScanDelta, diff
from .disk_scrub import NEAR_WRITE_S, SUSPECTS_PER_FIND, DiskScrubber

__all__ = ["DiskWatcher", "MergeResult", "ScanDelta", "SharedDiskView", "diff"]

logger = logging.getLogger("vllm.kvlens")

_SETTLE_S = 10.0  # a local change this much older than a scan is visible in it (writes may lag)
STARTUP_WAIT_S = 5.0
# Changes a step merges at most: indexing a million files at start-up is spread over many
# steps (milliseconds each), not one step that stalls for seconds.
MERGE_PER_STEP = 8192


@dataclass(frozen=True, slots=True)
class MergeResult:
    evict: list[str]  # chunks to delete to keep the directory within its budget
    gone: list[str]  # chunks another engine deleted (they left the index)


class DiskWatcher:
    """Rescans the directory and applies access-time touches, in a daemon thread."""

    def __init__(
        self, disk: DiskTier, world_size: int, interval_s: float, startup_wait_s: float = STARTUP_WAIT_S
    ) -> None:
        self._disk, self._world, self._interval = disk, world_size, interval_s
        self.scanner = DirectoryScanner(disk.root, world_size)
        self._deltas: deque[ScanDelta] = deque()
        self._touches: deque[str] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._indexed = threading.Event()
        self._scan_failing = False
        self._last_scan_started = 0.0
        self._thread = threading.Thread(target=self._run, name="kvlens-disk-scan", daemon=True)
        self._thread.start()
        if not self._indexed.wait(startup_wait_s):
            logger.info("KVLens: indexing the disk tier %s goes on in the background", disk.root)

    def touch(self, names: Iterable[str]) -> None:
        self._touches.extend(names)
        self._wake.set()

    @property
    def last_scan_started(self) -> float:
        """Wall-clock start of the newest finished scan (0 before the first)."""
        return self._last_scan_started

    def holds(self, name: str) -> FileInfo | None:
        """The chunk as the newest scan saw it (None: not in the directory)."""
        return self.scanner.holds(name)

    def take(self, max_changes: int | None = None) -> list[ScanDelta]:
        """The scans' deltas in order; with ``max_changes``, only as many as hold about that many
        changes (a delta is never cut: the watcher queued big ones in pieces)."""
        out: list[ScanDelta] = []
        taken = 0
        while self._deltas and (max_changes is None or taken < max_changes):
            delta = self._deltas.popleft()
            out.append(delta)
            taken += len(delta)
        return out

    def _run(self) -> None:
        started = time.monotonic()
        self._scan()
        self._indexed.set()
        logger.info(
            "KVLens: indexed %d chunks of the disk tier %s in %.1f s",
            len(self.scanner),
            self._disk.root,
            time.monotonic() - started,
        )
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
            try:
                for rank in range(self._world):
                    self._disk.touch(storage_name(digest, rank))
                self._disk.mark_used(digest)
            except OSError as e:
                logger.debug("KVLens: touching %s failed: %s", digest[:12], e)

    def _scan(self) -> None:
        delta = self.scanner.scan()
        self._last_scan_started = delta.started
        if delta:
            self._deltas.extend(delta.pieces(MERGE_PER_STEP))
        error = self.scanner.error
        if error is not None and not self._scan_failing:  # the rest of the view is kept; say so once
            logger.warning("KVLens: disk scans of %s fail: %s", self._disk.root, error)
        elif error is None and self._scan_failing:
            logger.info("KVLens: disk scans of %s work again", self._disk.root)
        self._scan_failing = error is not None

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)


class SharedDiskView:
    """The scheduler's side: merges scan deltas into the disk index, on the scheduler thread,
    and takes what the scrub (``disk_scrub.py``) found damaged."""

    def __init__(
        self,
        index: TierIndex,
        watcher: DiskWatcher,
        evicts: bool,
        grace_s: float,
        scrub: DiskScrubber | None = None,
    ) -> None:
        self._index = index
        self._watcher = watcher
        self.scrub = scrub
        self._evicts = evicts
        self._touch_every_ns = int(grace_s * 1e9 / 4)
        self._changed: dict[str, float] = {}  # digest -> when this engine admitted/evicted it
        self._touched_ns: dict[str, int] = {}
        self._recheck: set[str] = set()  # changed by a scan while our own change was settling

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

    def merge(self) -> MergeResult:
        """Apply the scans that arrived: what to evict to keep the directory in budget, and
        which chunks other engines deleted."""
        deltas = self._watcher.take(MERGE_PER_STEP)
        if not deltas and not self._recheck:
            return MergeResult([], [])
        gone: list[str] = []
        for delta in deltas:
            self._apply(delta, gone)
        self._recheck_settled(self._watcher.last_scan_started - _SETTLE_S, gone)
        if not self._evicts or not deltas:
            return MergeResult([], gone)
        victims = self._index.overflow_victims()
        self.note_changed(victims)
        return MergeResult(victims, gone)

    def _apply(self, delta: ScanDelta, gone: list[str]) -> None:
        index = self._index
        settle = delta.started - _SETTLE_S
        if self._changed:
            self._changed = {k: t for k, t in self._changed.items() if t >= settle - 60.0}
        for name in delta.removed:
            if self._changed.get(name, 0) >= settle:  # our own write may not have landed yet
                self._recheck.add(name)
            elif index.remove(name):
                gone.append(name)  # deleted by another engine
        fresh = []
        for name, info in delta.added.items():
            if name in index:
                index.update_size(name, info.nbytes)  # the file's size, header included
            elif self._changed.get(name, 0) >= settle:  # our own delete may not have landed yet
                self._recheck.add(name)
            else:
                fresh.append((name, info))
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

    def _recheck_settled(self, settle: float, gone: list[str]) -> None:
        """Chunks a scan saw change while this engine's own change to them was in flight: once
        that change is older than the latest scan by the settle time, the scan's view is true."""
        index = self._index
        for name in [n for n in self._recheck if self._changed.get(n, 0) < settle]:
            self._recheck.discard(name)
            info = self._watcher.holds(name)
            if info is None:
                if index.remove(name):
                    gone.append(name)
            elif name not in index:
                index.add_known(name, info.nbytes, most_recent=True)

    def load_found_damaged(self, damaged: str) -> None:
        """A load found ``damaged``'s record damaged (call before forgetting it): what this engine
        stored about when it stored that chunk is verified at once, and the scrub adds what the
        last rescan saw written then by any engine. (The rest of the load's prefix in this tier
        is forgotten and deleted anyway.)"""
        if self.scrub is None:
            return
        suspects: list[str] = []
        when = self._changed.get(damaged)
        if when is not None:
            near = [(abs(t - when), n) for n, t in self._changed.items() if abs(t - when) <= NEAR_WRITE_S]
            suspects = [n for _, n in sorted(near)[:SUSPECTS_PER_FIND]]
        self.scrub.load_found_damaged(damaged, [n for n in suspects if n != damaged and n in self._index])

    def take_damaged(self) -> list[str]:
        """Chunks the scrub found damaged (and removed) since the last call."""
        return self.scrub.take_damaged() if self.scrub is not None else []

    def stop(self) -> None:
        if self.scrub is not None:
            self.scrub.stop()
        self._watcher.stop()
