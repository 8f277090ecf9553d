"""Finds damaged records on the disk tier before a load does.

A record overwritten in place changes no directory time, so rescans (``disk_sync.py``) never
see it, and a load that finds one damaged tells nothing about the chunks beyond it: they are
found one round at a time. So a daemon thread on the scheduler's side verifies records the way
a load does (the tier's own ``get``: header, size and checksum, and removes one found damaged):

- Suspects first, at once: when a load finds a record damaged, the other disk chunks of that
  load and every record the last scan saw written within ``NEAR_WRITE_S`` of it (the same
  batch, and what a damage of many files at once hit), at most ``SUSPECTS_PER_FIND`` of them.
- Then, at most ``bytes_per_s`` (``extra_config.disk_scrub_bytes_per_s``; 0: off), every
  record the last scan saw written at least ``WALK_MIN_AGE_S`` ago, one pass after another.
  A younger record was checksummed from memory moments ago; damage to it is for loads (and
  their suspects) to find, so the walk never races a load for a fresh record.

Damaged chunks are handed to the scheduler (``take_damaged``), which forgets them like a failed
load's (every rank's file is deleted). A read for verification leaves the file's access time
as it was, so a scrub does not count as a use in the shared recency (``disk.py``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from ..engine.keys import storage_name
from ..tiers.base import ChunkCorrupt, ChunkMissing
from ..tiers.disk import DiskTier, FileInfo

logger = logging.getLogger("vllm.kvlens")

NEAR_WRITE_S = 5.0  # records written this close to a damaged one are verified at once
SUSPECTS_PER_FIND = 4096  # at most this many of them, the closest in write time first
MAX_SUSPECTS = 65_536  # queued suspects kept at most (the oldest are dropped: the walk finds them)
IDLE_WAIT_S = 1.0  # nothing to verify: look again this often (a wake comes sooner)
WALK_MIN_AGE_S = 600.0  # the walk leaves records younger than this alone

Listing = Callable[[], list[tuple[str, FileInfo]]]  # every chunk the last scan saw, with its facts


class DiskScrubber:
    def __init__(
        self,
        disk: DiskTier,
        listing: Listing,
        world_size: int,
        bytes_per_s: float,
        start: bool = True,
        min_age_s: float = WALK_MIN_AGE_S,
    ) -> None:
        self._disk, self._listing, self._world = disk, listing, world_size
        self._rate = max(bytes_per_s, 0.0)
        self._min_age_ns = int(min_age_s * 1e9)
        self._suspects: deque[str] = deque()
        self._queued: set[str] = set()
        self._near_of: deque[str] = deque()  # chunks found damaged whose neighbours are due
        self._damaged: deque[str] = deque()
        self._walk: list[str] = []  # what is left of the current pass, last first
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.scrubbed_records = 0  # rank files read and checked
        self.scrubbed_bytes = 0
        self.damaged_found = 0  # chunks found damaged
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(target=self._run, name="kvlens-disk-scrub", daemon=True)
            self._thread.start()

    # ---- the scheduler's side -----------------------------------------------------------
    def load_found_damaged(self, damaged: str, others: Iterable[str]) -> None:
        """A load found ``damaged``'s record damaged: verify ``others`` (the rest of that load)
        and the records written about when it was, before any pass reaches them."""
        self.suspect(others)
        self._near_of.append(damaged)
        self._wake.set()

    def suspect(self, digests: Iterable[str]) -> None:
        with self._lock:
            for digest in digests:
                if digest not in self._queued:
                    self._queued.add(digest)
                    self._suspects.append(digest)
            while len(self._suspects) > MAX_SUSPECTS:
                self._queued.discard(self._suspects.popleft())
        self._wake.set()

    @property
    def busy(self) -> bool:
        """Damage found and not yet taken: worth an idle engine's step."""
        return bool(self._damaged)

    def take_damaged(self) -> list[str]:
        out: list[str] = []
        while self._damaged:
            out.append(self._damaged.popleft())
        return out

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # ---- the thread's side --------------------------------------------------------------
    def work(self) -> int | None:
        """Verify what is due next: a suspect, else (if the walk is on) the next record of the
        pass. Returns the bytes read from a walk (the rate's share), 0 for a suspect, None when
        nothing was due."""
        self._expand_near()
        with self._lock:
            digest = self._suspects.popleft() if self._suspects else None
            if digest is not None:
                self._queued.discard(digest)
        if digest is not None:
            self.verify(digest)
            return 0
        if self._rate <= 0:
            return None
        if not self._walk:
            written_before = time.time_ns() - self._min_age_ns
            self._walk = [name for name, info in self._listing() if info.mtime_ns <= written_before]
            self._walk.reverse()
            if not self._walk:
                return None
        return self.verify(self._walk.pop())

    def verify(self, digest: str) -> int:
        """Read and check every rank's record of ``digest``; a damaged one is removed and the
        chunk handed to the scheduler. Returns the bytes read."""
        nbytes = 0
        damaged = False
        for rank in range(self._world):
            name = storage_name(digest, rank)
            path = self._disk.path(name)
            try:
                before = os.stat(path)
            except OSError:  # not there (another engine deleted it, a legacy path): nothing to check
                continue
            try:
                self._disk.get(name)
            except ChunkMissing:
                continue
            except ChunkCorrupt as e:
                logger.warning("KVLens: the disk scrub found %s damaged (%s); it is removed", name[:12], e)
                damaged = True
            except OSError as e:  # the tier's health is the loads' to judge
                logger.debug("KVLens: the disk scrub could not read %s: %s", name[:12], e)
                continue
            else:
                _keep_access_time(path, before)
            nbytes += before.st_size
            self.scrubbed_records += 1
        self.scrubbed_bytes += nbytes
        if damaged:
            self._damaged.append(digest)
            self.damaged_found += 1
        return nbytes

    def _expand_near(self) -> None:
        """Records written about when a damaged one was become suspects (closest first)."""
        if not self._near_of:
            return
        names = []
        while self._near_of:
            names.append(self._near_of.popleft())
        listing = self._listing()
        facts = dict(listing)
        window = int(NEAR_WRITE_S * 1e9)
        for damaged in names:
            info = facts.get(damaged)
            if info is None:
                continue
            near = [(abs(i.mtime_ns - info.mtime_ns), n) for n, i in listing if n != damaged]
            near = [x for x in near if x[0] <= window]
            near.sort()
            self.suspect(n for _, n in near[:SUSPECTS_PER_FIND])

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                read = self.work()
            except Exception:  # noqa: BLE001 - a scrub that failed once is tried again later
                logger.exception("KVLens: the disk scrub failed")
                read = None
            if read is None:
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
            elif read > 0:
                self._wake.wait(read / self._rate)  # the walk's pace; a suspect cuts it short
                self._wake.clear()


def _keep_access_time(path: str, before: os.stat_result) -> None:
    """A verifying read is no use: put back the access time a read may have moved (relatime
    moves it once a day), unless the file changed meanwhile."""
    try:
        after = os.stat(path)
        if after.st_atime_ns != before.st_atime_ns and after.st_mtime_ns == before.st_mtime_ns:
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    except OSError:
        pass
