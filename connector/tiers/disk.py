"""Local-disk tier: one self-checking file per chunk and rank, written atomically.

A record is written to a temporary file in the same directory and renamed into place, so
a reader sees either no file or a whole one; a crash mid-write leaves only a temp file
that ``scan`` ignores and ``sweep_temp_files`` removes.

Several engines may share one directory (see ``connector/disk_sync.py``). A file's access
time records when an engine last used it for a load: a write sets it just past the
modification time (so that reads on ``relatime`` mounts leave it alone), and a lookup that
pins the chunk sets it to the present; a file whose access time is later than its write by
more than ``_TOUCHED_NS`` has been used. ``delete`` leaves a file alone that a lookup marked within
``grace_s``, or that another engine wrote within it, because another engine may be about to
load it; a corrupt file is removed when it is read
(only if it is still the same file, not a fresh copy another engine wrote meanwhile).
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from dataclasses import dataclass

from . import codec
from .base import ChunkCorrupt, ChunkMissing

SUFFIX = ".kvlens"
_NAME = re.compile(r"^([0-9a-f]{32})\.r(\d+)\.kvlens$")
_TEMP_PREFIX = ".tmp-"
NEVER_USED_NS = 0  # FileInfo.used_ns of a file no engine has pinned for a load yet
_TOUCHED_NS = 1_000_000  # an access time this much past the write time was set by a touch


@dataclass(frozen=True, slots=True)
class FileInfo:
    nbytes: int  # the largest rank file
    mtime_ns: int  # last write (newest rank file)
    used_ns: int  # last use by a load (newest rank file), or NEVER_USED_NS

    @property
    def last_used_ns(self) -> int:
        return max(self.mtime_ns, self.used_ns)


class DiskTier:
    name = "disk"

    def __init__(self, root: str, layout: str, grace_s: float = 30.0, remove_corrupt: bool = True) -> None:
        self.root = root
        self._layout = layout
        self._grace_ns = int(grace_s * 1e9)
        self._remove_corrupt = remove_corrupt
        self._own: set[str] = set()  # names this process wrote (and has not deleted since)
        os.makedirs(root, exist_ok=True)

    def path(self, name: str) -> str:
        return os.path.join(self.root, name + SUFFIX)

    def put(self, name: str, payload: memoryview, namespace: str = "") -> int:
        header = codec.encode_header(name, self._layout, payload, namespace)
        try:
            fd, tmp = tempfile.mkstemp(prefix=_TEMP_PREFIX, dir=self.root)
        except FileNotFoundError:  # the directory was removed under us: recreate it once
            os.makedirs(self.root, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=_TEMP_PREFIX, dir=self.root)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload)
            written = time.time_ns()
            os.utime(tmp, ns=(written + 1, written))
            os.replace(tmp, self.path(name))
        except BaseException:
            _unlink(tmp)
            raise
        self._own.add(name)
        return len(header) + payload.nbytes

    def get(self, name: str) -> memoryview:
        path = self.path(name)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                record = bytearray(st.st_size)
                if f.readinto(record) != st.st_size:
                    raise ChunkCorrupt(f"{name}: short read")
        except FileNotFoundError:
            raise ChunkMissing(name) from None
        try:
            return codec.decode(record, name, self._layout)
        except ChunkCorrupt:
            if self._remove_corrupt:
                _unlink_if_same(path, st.st_ino, st.st_mtime_ns)
            raise

    def delete(self, name: str) -> bool:
        """Remove the chunk unless another engine may be about to load it; False if kept."""
        path = self.path(name)
        if self._grace_ns:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                self._own.discard(name)
                return True
            recent = time.time_ns() - self._grace_ns
            if _used_ns(st) > recent or (name not in self._own and st.st_mtime_ns > recent):
                return False
        _unlink(path)
        self._own.discard(name)
        return True

    def stored_size(self, name: str) -> int:
        try:
            return os.stat(self.path(name)).st_size
        except FileNotFoundError:
            return 0

    def touch(self, name: str) -> None:
        """Mark the chunk as about to be loaded, so that no engine deletes it for a while."""
        path = self.path(name)
        try:
            st = os.stat(path)
            os.utime(path, ns=(time.time_ns(), st.st_mtime_ns))
        except FileNotFoundError:
            pass

    def clear(self) -> None:
        for entry in os.scandir(self.root):
            if _NAME.match(entry.name):
                _unlink(entry.path)

    def probe(self) -> None:
        """Write, read back and remove a small record; raises OSError when the disk fails."""
        name = f".probe-{os.getpid()}"
        data = memoryview(os.urandom(4096))
        self.put(name, data)
        try:
            if bytes(self.get(name)) != bytes(data):
                raise OSError(f"probe record in {self.root} read back wrong")
        except ChunkCorrupt as e:
            raise OSError(str(e)) from e
        finally:
            _unlink(self.path(name))


def scan(root: str, world_size: int) -> dict[str, FileInfo]:
    """Chunks on disk for which every rank's file exists."""
    ranks: dict[str, dict[int, os.stat_result]] = {}
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return {}
    for entry in entries:
        m = _NAME.match(entry.name)
        if not m:
            continue
        try:
            st = entry.stat()
        except FileNotFoundError:
            continue
        ranks.setdefault(m.group(1), {})[int(m.group(2))] = st
    out: dict[str, FileInfo] = {}
    for digest, stats in ranks.items():
        if all(r in stats for r in range(world_size)):
            files = [stats[r] for r in range(world_size)]
            out[digest] = FileInfo(
                max(s.st_size for s in files),
                max(s.st_mtime_ns for s in files),
                max(_used_ns(s) for s in files),
            )
    return out


def sweep_temp_files(root: str, older_than_s: float = 600.0) -> int:
    """Remove temp files left by writers that died; returns how many were removed."""
    removed = 0
    cutoff = time.time() - older_than_s
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return 0
    for entry in entries:
        if entry.name.startswith(_TEMP_PREFIX):
            try:
                if entry.stat().st_mtime < cutoff:
                    os.unlink(entry.path)
                    removed += 1
            except FileNotFoundError:
                pass
    return removed


def _used_ns(st: os.stat_result) -> int:
    """When a lookup last marked the file as about to be loaded (NEVER_USED_NS if never)."""
    return st.st_atime_ns if st.st_atime_ns > st.st_mtime_ns + _TOUCHED_NS else NEVER_USED_NS


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _unlink_if_same(path: str, inode: int, mtime_ns: int) -> None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if st.st_ino == inode and st.st_mtime_ns == mtime_ns:
        _unlink(path)
