"""What changed in a disk tier's directory, at a cost that grows with the changes, not the files.

Every chunk file sits in one of 4096 subdirectories (``disk.py``). Creating, renaming or
deleting a file in a directory moves the directory's modification time, and a load's touch
moves it on purpose, so a rescan stats the root and each subdirectory and re-lists only those
whose time moved: about 4,000 stats whether the tier holds ten thousand chunks or a million,
plus a listing of each subdirectory that changed (a million chunks: ~250 files each).

A directory time has a granularity (a clock tick locally, up to seconds on some file systems),
so a change in the same tick as the listing before it would leave the time as it was: a
directory whose time was within ``RACY_NS`` of its listing is listed again next time. Over NFS
a directory's time is as fresh as the client's attribute cache (``acdirmax``, 60 s by
default): changes from other hosts show up that much later.

Chunk files in the root were written by versions before the subdirectories: a listing of the
root moves them into their subdirectory, or, where it may not (a read-only mount), indexes
them where they are. Temp files older than ``TEMP_MAX_AGE_S`` (a writer died) are removed from
any directory listed.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

from .disk import (
    CHUNK_NAME,
    FANOUT_DIGITS,
    SUBDIR_NAME,
    TEMP_PREFIX,
    USE_MARK_PREFIX,
    FileInfo,
    chunk_path,
    file_info,
    remove_if_older,
)

logger = logging.getLogger("vllm.kvlens")

RACY_NS = 1_000_000_000
TEMP_MAX_AGE_S = 600.0
USE_MARK_MAX_AGE_S = 60.0  # every engine's rescans (each disk_scan_interval_s) saw it by then
_ROOT = ""  # the listing key of the root itself (chunk files of the flat layout)


@dataclass(slots=True)
class ScanDelta:
    started: float  # wall-clock time the scan began
    added: dict[str, FileInfo] = field(default_factory=dict)  # new or rewritten chunk files
    removed: set[str] = field(default_factory=set)
    used: set[str] = field(default_factory=set)  # loaded by some engine since the last scan

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.used)

    def __len__(self) -> int:
        return len(self.added) + len(self.removed) + len(self.used)

    def pieces(self, size: int) -> list[ScanDelta]:
        """This delta cut into pieces of at most ``size`` added files, the most recently used
        first (merged in that order, each piece's older files go in front of the last's)."""
        if len(self.added) <= size:
            return [self]
        ordered = sorted(self.added.items(), key=lambda kv: kv[1].last_used_ns, reverse=True)
        out = [ScanDelta(self.started, dict(ordered[i : i + size])) for i in range(0, len(ordered), size)]
        out[0].removed, out[0].used = self.removed, self.used
        return out


def diff(before: dict[str, FileInfo], after: dict[str, FileInfo], started: float) -> ScanDelta:
    delta = ScanDelta(started)
    _diff_into(delta, before, after)
    return delta


def _diff_into(delta: ScanDelta, before: dict[str, FileInfo], after: dict[str, FileInfo]) -> None:
    for name, info in after.items():
        old = before.get(name)
        if old is None or old.mtime_ns != info.mtime_ns:
            delta.added[name] = info
        elif info.used_ns > old.used_ns:
            delta.used.add(name)
    delta.removed.update(name for name in before if name not in after)


@dataclass(slots=True)
class _Listing:
    mtime_ns: int  # the directory's modification time, read before it was listed
    listed_ns: int  # wall clock when it was listed
    chunks: dict[str, FileInfo]
    marks: dict[str, tuple[int, int]]  # use marks: name -> (inode, mtime_ns)


@dataclass(slots=True)
class ScanCost:
    """What rescans cost so far: directories whose time was read, listed, files stat'ed."""

    dirs_checked: int = 0
    dirs_listed: int = 0
    files_stated: int = 0


class DirectoryScanner:
    """This process's last view of one tier directory; ``scan()`` returns what changed since."""

    def __init__(self, root: str, world_size: int) -> None:
        self.root = root
        self._world = world_size
        self._listings: dict[str, _Listing] = {}
        self._subdirs: dict[str, str] = {}  # name -> path
        self._migrate = True  # until a move fails (read-only): then flat files are read in place
        self.cost = ScanCost()
        self.error: OSError | None = None  # the first error of the last scan (its view is kept)

    def __len__(self) -> int:
        return sum(len(listing.chunks) for listing in self._listings.values())

    def holds(self, digest: str) -> FileInfo | None:
        """The chunk as the last scan saw it. Safe from another thread: listings are replaced
        whole, never changed in place."""
        for key in (digest[:FANOUT_DIGITS], _ROOT):
            listing = self._listings.get(key)
            if listing is not None and digest in listing.chunks:
                return listing.chunks[digest]
        return None

    def chunks(self) -> list[tuple[str, FileInfo]]:
        """Every chunk the last scan saw, with its files' facts (safe from another thread)."""
        out: list[tuple[str, FileInfo]] = []
        for listing in list(self._listings.values()):
            out.extend(listing.chunks.items())
        return out

    def scan(self) -> ScanDelta:
        self.error = None
        delta = ScanDelta(time.time())
        if not self._check(_ROOT, self.root, delta):  # the whole directory is gone
            for key in list(self._listings):
                self._drop(key, delta)
            self._subdirs.clear()
            return delta
        for sub, path in list(self._subdirs.items()):
            self._check(sub, path, delta)
        delta.removed.difference_update(delta.added)  # moved out of the root
        return delta

    def _check(self, key: str, path: str, delta: ScanDelta) -> bool:
        """Re-list the directory if its time moved; False when it no longer exists."""
        self.cost.dirs_checked += 1
        try:
            mtime = os.stat(path).st_mtime_ns
            old = self._listings.get(key)
            if old is not None and mtime == old.mtime_ns and mtime < old.listed_ns - RACY_NS:
                return True
            now = time.time_ns()
            listing, subdirs = self._list(key, path, mtime, now, old)
        except FileNotFoundError:
            self._drop(key, delta)
            return False
        except OSError as e:  # keep the last view of this directory; try again next scan
            self.error = self.error or e
            return True
        self._listings[key] = listing
        _diff_into(delta, old.chunks if old is not None else {}, listing.chunks)
        if key == _ROOT:
            for gone in self._subdirs.keys() - subdirs:
                self._drop(gone, delta)
            self._subdirs = {sub: os.path.join(self.root, sub) for sub in sorted(subdirs)}
        return True

    def _list(
        self, key: str, path: str, mtime: int, now: int, old: _Listing | None
    ) -> tuple[_Listing, set[str]]:
        """The directory's complete chunks and, for the root, its subdirectories. Files a
        listing before saw (same inodes) keep what it read, unless their use mark is new."""
        self.cost.dirs_listed += 1
        world = self._world
        ranks: dict[str, list[os.DirEntry[str] | None]] = {}  # digest -> its rank files
        marks: dict[str, tuple[int, int]] = {}
        subdirs: set[str] = set()
        now_s = time.time()
        with os.scandir(path) as entries:
            for entry in entries:
                name = entry.name
                m = CHUNK_NAME.match(name)
                if m is not None:
                    digest, rank = m.groups()
                    if key == _ROOT and self._migrate and self._moved(entry, name):
                        subdirs.add(digest[:FANOUT_DIGITS])
                    elif (key == _ROOT or digest.startswith(key)) and int(rank) < world:  # where readers look
                        found = ranks.get(digest)
                        if found is None:
                            found = ranks[digest] = [None] * world
                        found[int(rank)] = entry
                elif name.startswith(USE_MARK_PREFIX):
                    self._read_mark(entry, marks, now_s - USE_MARK_MAX_AGE_S)
                elif name.startswith(TEMP_PREFIX):
                    remove_if_older(entry, now_s - TEMP_MAX_AGE_S)
                elif key == _ROOT and SUBDIR_NAME.match(name) and entry.is_dir():
                    subdirs.add(name)
        before = old.chunks if old is not None else {}
        seen_marks = old.marks if old is not None else {}
        used = {n[len(USE_MARK_PREFIX) :] for n, mark in marks.items() if seen_marks.get(n) != mark}
        chunks: dict[str, FileInfo] = {}
        for digest, found in ranks.items():
            if None in found:
                continue  # a rank's file is missing: not a whole chunk
            identity = found[0].inode() if world == 1 else hash(tuple(e.inode() for e in found))  # type: ignore[union-attr]
            known = before.get(digest)
            if known is not None and known.identity == identity and digest not in used:
                chunks[digest] = known
                continue
            try:
                stats = [e.stat() for e in found]  # type: ignore[union-attr]
            except FileNotFoundError:
                continue
            self.cost.files_stated += len(stats)
            chunks[digest] = file_info(stats, identity)
        return _Listing(mtime, now, chunks, marks), subdirs

    @staticmethod
    def _read_mark(entry: os.DirEntry[str], marks: dict[str, tuple[int, int]], expired_s: float) -> None:
        """A use mark, by inode and time (a replaced one differs); an old one is removed."""
        try:
            st = entry.stat()
        except FileNotFoundError:
            return
        if st.st_mtime < expired_s:
            remove_if_older(entry, expired_s)
        else:
            marks[entry.name] = (st.st_ino, st.st_mtime_ns)

    def _moved(self, entry: os.DirEntry[str], name: str) -> bool:
        """Move a flat-layout file into its subdirectory; False where that is not allowed."""
        dest = chunk_path(self.root, name[: -len(".kvlens")])
        try:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            if os.path.exists(dest):  # a copy in the new layout wins
                os.unlink(entry.path)
            else:
                os.rename(entry.path, dest)
        except FileNotFoundError:
            return True  # another engine moved it first
        except OSError as e:
            logger.warning(
                "KVLens: cannot move chunk files of %s into subdirectories (%s); reading them in place",
                self.root,
                e,
            )
            self._migrate = False
            return False
        return True

    def _drop(self, key: str, delta: ScanDelta) -> None:
        """Everything in a directory that disappeared."""
        gone = self._listings.pop(key, None)
        if gone is not None:
            delta.removed.update(gone.chunks)
