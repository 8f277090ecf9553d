"""Local-disk tier: one self-checking file per chunk and rank, written atomically.

Files live in 4096 subdirectories named by the first three hex digits of the chunk's digest
(``<root>/3fa/3fa9…e1.r0.kvlens``), so that a watcher learns what changed by checking each
subdirectory's modification time and re-listing only those that moved (``disk_scan.py``);
a flat directory of a million files would have to be listed whole. Directories written by
older versions (chunk files directly in the root) are still read, and moved into place by
the first scan that can (``disk_scan.py``).

A record is written to a temporary file in its subdirectory and renamed into place, so a
reader sees either no file or a whole one; a crash mid-write leaves only a temp file that
scans ignore and remove once old.

Several engines may share one directory (see ``connector/scheduler/disk_sync.py``). A file's access
time records when an engine last used it for a load: a write sets it a second past the
modification time (``WRITE_MARK_NS``: reads on ``relatime`` mounts leave it alone), and a lookup that
pins the chunk sets it to the present and replaces the chunk's use mark (``.used-<digest>``)
in the subdirectory, so the other engines' watchers re-list it and see the use; a file whose
access time is later than its write by more than ``_TOUCHED_NS`` has been used. ``delete``
leaves a file alone that a lookup marked within ``grace_s``, or that another engine wrote
within it, because another engine may be about to load it; a corrupt file is removed when it
is read (only if it is still the same file, not a fresh copy another engine wrote meanwhile).
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass

from . import codec
from .base import ChunkCorrupt, ChunkMissing
from .read_buffers import ReadBuffers
from .record_trust import OPEN, RecordTrust

SUFFIX = ".kvlens"
FANOUT_DIGITS = 3  # a chunk's subdirectory: this many leading hex digits of its digest
CHUNK_NAME = re.compile(r"^([0-9a-f]{32})\.r(\d+)\.kvlens$")
SUBDIR_NAME = re.compile(rf"^[0-9a-f]{{{FANOUT_DIGITS}}}$")
TEMP_PREFIX = ".tmp-"
USE_MARK_PREFIX = ".used-"  # ``.used-<digest>``: recreated by each touch, so rescans see the use
NEVER_USED_NS = 0  # FileInfo.used_ns of a file no engine has pinned for a load yet
_TOUCHED_NS = 1_000_000  # an access time this much past the write time was set by a touch
# A write sets the access time exactly this far past its modification time: ahead of the change
# times the kernel stamps at the calls that follow (the utime, the rename), however late they run
# on a loaded machine, so that a read on a relatime mount (Linux updates a read file's access time
# when its change or modification time is at or after it) leaves it alone. This exact offset is
# the mark of a record nobody has touched (any other access time past its write by more than
# _TOUCHED_NS is a use).
WRITE_MARK_NS = 1_000_000_007


@dataclass(frozen=True, slots=True)
class FileInfo:
    nbytes: int  # the largest rank file
    mtime_ns: int  # last write (newest rank file)
    used_ns: int  # last use by a load (newest rank file), or NEVER_USED_NS
    identity: int = 0  # the rank files' inodes: the same files as a listing before

    @property
    def last_used_ns(self) -> int:
        return max(self.mtime_ns, self.used_ns)


def chunk_path(root: str, name: str) -> str:
    """Where the record of ``name`` (``<digest>.r<rank>``) lives; other names stay in the root."""
    sub = name[:FANOUT_DIGITS]
    if SUBDIR_NAME.match(sub):
        return os.path.join(root, sub, name + SUFFIX)
    return os.path.join(root, name + SUFFIX)


def legacy_path(root: str, name: str) -> str:
    """Where versions before the subdirectories kept it (still read, moved by scans)."""
    return os.path.join(root, name + SUFFIX)


def chunk_files(root: str) -> list[str]:
    """Paths of every chunk file under ``root``, in either layout (tools and tests)."""
    out: list[str] = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return out
    for entry in entries:
        if CHUNK_NAME.match(entry.name):
            out.append(entry.path)
        elif SUBDIR_NAME.match(entry.name) and entry.is_dir():
            try:
                out.extend(e.path for e in os.scandir(entry.path) if CHUNK_NAME.match(e.name))
            except FileNotFoundError:  # removed meanwhile
                continue
    return sorted(out)


class DiskTier:
    name = "disk"

    def __init__(
        self,
        root: str,
        layout: str,
        grace_s: float = 30.0,
        remove_corrupt: bool = True,
        layers: int = 0,
        trust: RecordTrust = OPEN,
    ) -> None:
        self.root = root
        self.layout = layout
        self.trust = trust  # the store key records must be tagged with, and their largest size
        self._layers = layers  # > 1: records carry a checksum per layer (read a layer at a time)
        self.read_buffers = ReadBuffers()  # what layer-wise loads read into, reused
        self.reads_nowait = hasattr(os, "RWF_NOWAIT")  # False once the file system refuses it
        self._grace_ns = int(grace_s * 1e9)
        self._remove_corrupt = remove_corrupt
        # Names this process wrote within the grace period (and has not deleted since), by
        # write time: older ones need no exemption, so the table holds only recent writes.
        self._written: OrderedDict[str, int] = OrderedDict()
        os.makedirs(root, exist_ok=True)

    def path(self, name: str) -> str:
        return chunk_path(self.root, name)

    @property
    def recent_writes(self) -> int:
        return len(self._written)

    def put(self, name: str, payload: memoryview, namespace: str = "") -> int:
        header = codec.encode_header(name, self.layout, payload, namespace, self._layers, self.trust)
        path = self.path(name)
        folder = os.path.dirname(path)
        try:
            fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=folder)
        except FileNotFoundError:  # a new subdirectory, or the directory was removed under us
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload)
            written = time.time_ns()
            os.utime(tmp, ns=(written + WRITE_MARK_NS, written))  # see WRITE_MARK_NS
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise
        self._note_written(name, written)
        return len(header) + payload.nbytes

    def open_record(self, name: str) -> tuple[int, str]:
        """A read-only descriptor of the chunk's record, and its path; ChunkMissing if none."""
        for path in (self.path(name), legacy_path(self.root, name)):
            try:
                return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)), path
            except FileNotFoundError:
                continue
        raise ChunkMissing(name)

    def get(self, name: str) -> memoryview:
        fd, path = self.open_record(name)
        with open(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if self.trust.too_large(st.st_size, whole_record=True):  # e.g. a sparse file: never read
                self.remove_if_corrupt(path, st.st_ino, st.st_mtime_ns)
                raise ChunkCorrupt(f"{name}: a file of {st.st_size} bytes, larger than any chunk record")
            record = bytearray(st.st_size)
            if f.readinto(record) != st.st_size:
                raise ChunkCorrupt(f"{name}: short read")
        try:
            return codec.decode(record, name, self.layout, self.trust)
        except ChunkCorrupt:
            self.remove_if_corrupt(path, st.st_ino, st.st_mtime_ns)
            raise

    def remove_if_corrupt(self, path: str, inode: int, mtime_ns: int) -> None:
        """A record found corrupt is removed, if it is still the same file (not a fresh copy
        another engine wrote meanwhile) and this tier may (not a tool's read-only view)."""
        if self._remove_corrupt:
            _unlink_if_same(path, inode, mtime_ns)

    def delete(self, name: str) -> bool | None:
        """Remove the chunk unless another engine may be about to load it.

        True: this call removed it; False: kept (in use); None: nothing was there (another
        engine deleted it first)."""
        found = self._stat(name)
        if found is None:
            self._written.pop(name, None)
            return None
        path, st = found
        if self._grace_ns:
            recent = time.time_ns() - self._grace_ns
            if _used_ns(st) > recent or (name not in self._written and st.st_mtime_ns > recent):
                return False
        self._written.pop(name, None)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return None
        return True

    def stored_size(self, name: str) -> int:
        found = self._stat(name)
        return found[1].st_size if found is not None else 0

    def touch(self, name: str) -> None:
        """Mark the chunk as about to be loaded, so that no engine deletes it for a while."""
        found = self._stat(name)
        if found is None:
            return
        path, st = found
        try:
            touched = max(time.time_ns(), st.st_mtime_ns + 2 * _TOUCHED_NS)  # a use, however soon
            if touched == st.st_mtime_ns + WRITE_MARK_NS:
                touched += 1  # never the untouched write's own mark
            os.utime(path, ns=(touched, st.st_mtime_ns))
        except FileNotFoundError:
            pass

    def mark_used(self, digest: str) -> None:
        """Replace the chunk's use mark, so that every engine's next rescan lists its directory
        and reads the files' times again (a touch alone changes no directory)."""
        folder = os.path.dirname(self.path(digest))
        try:
            fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=folder)
        except FileNotFoundError:  # no chunk there any more
            return
        os.close(fd)
        try:
            os.replace(tmp, os.path.join(folder, USE_MARK_PREFIX + digest))
        except OSError:
            _unlink(tmp)
            raise

    def clear(self) -> None:
        for path in chunk_files(self.root):
            _unlink(path)

    def probe(self) -> None:
        """Write, read back and remove a small record; raises OSError when the disk fails."""
        name = f".probe-{os.getpid()}"
        data = memoryview(os.urandom(min(4096, self.trust.max_payload_bytes or 4096)))
        self.put(name, data)
        try:
            if bytes(self.get(name)) != bytes(data):
                raise OSError(f"probe record in {self.root} read back wrong")
        except ChunkCorrupt as e:
            raise OSError(str(e)) from e
        finally:
            _unlink(self.path(name))
            self._written.pop(name, None)

    def _stat(self, name: str) -> tuple[str, os.stat_result] | None:
        for path in (self.path(name), legacy_path(self.root, name)):
            try:
                return path, os.stat(path)
            except FileNotFoundError:
                continue
        return None

    def _note_written(self, name: str, written_ns: int) -> None:
        if not self._grace_ns:
            return
        self._written[name] = written_ns
        self._written.move_to_end(name)
        expired = written_ns - self._grace_ns
        while self._written and next(iter(self._written.values())) < expired:
            self._written.popitem(last=False)


def sweep_temp_files(root: str, older_than_s: float = 600.0) -> int:
    """Remove temp files in the root left by writers that died (scans sweep the subdirectories)."""
    removed = 0
    cutoff = time.time() - older_than_s
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return 0
    for entry in entries:
        if entry.name.startswith(TEMP_PREFIX) and remove_if_older(entry, cutoff):
            removed += 1
    return removed


def remove_if_older(entry: os.DirEntry[str], cutoff_s: float) -> bool:
    try:
        st = entry.stat()
        if st.st_mtime < cutoff_s:
            _unlink_if_same(entry.path, st.st_ino, st.st_mtime_ns)
            return True
    except FileNotFoundError:
        pass
    return False


def file_info(stats: list[os.stat_result], identity: int = 0) -> FileInfo:
    """One chunk's entry from the stat results of its rank files."""
    if len(stats) == 1:
        (st,) = stats
        return FileInfo(st.st_size, st.st_mtime_ns, _used_ns(st), identity)
    return FileInfo(
        max(s.st_size for s in stats),
        max(s.st_mtime_ns for s in stats),
        max(_used_ns(s) for s in stats),
        identity,
    )


def _used_ns(st: os.stat_result) -> int:
    """When a lookup last marked the file as about to be loaded (NEVER_USED_NS if never)."""
    if st.st_atime_ns == st.st_mtime_ns + WRITE_MARK_NS:
        return NEVER_USED_NS  # as written
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
