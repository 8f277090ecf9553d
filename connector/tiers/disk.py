"""Local-disk tier: one self-checking file per chunk and rank, written atomically.

A record is written to a temporary file in the same directory and renamed into place, so
a reader sees either no file or a whole one; a crash mid-write leaves only a temp file
that ``scan`` ignores and ``sweep_temp_files`` removes.
"""

from __future__ import annotations

import os
import re
import tempfile
import time

from . import codec
from .base import ChunkCorrupt, ChunkMissing

SUFFIX = ".kvlens"
_NAME = re.compile(r"^([0-9a-f]{32})\.r(\d+)\.kvlens$")
_TEMP_PREFIX = ".tmp-"


class DiskTier:
    name = "disk"

    def __init__(self, root: str, layout: str) -> None:
        self.root = root
        self._layout = layout
        os.makedirs(root, exist_ok=True)

    def path(self, name: str) -> str:
        return os.path.join(self.root, name + SUFFIX)

    def put(self, name: str, payload: memoryview) -> int:
        header = codec.encode_header(name, self._layout, payload)
        try:
            fd, tmp = tempfile.mkstemp(prefix=_TEMP_PREFIX, dir=self.root)
        except FileNotFoundError:  # the directory was removed under us: recreate it once
            os.makedirs(self.root, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=_TEMP_PREFIX, dir=self.root)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, self.path(name))
        except BaseException:
            _unlink(tmp)
            raise
        return len(header) + payload.nbytes

    def get(self, name: str) -> memoryview:
        try:
            with open(self.path(name), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                record = bytearray(size)
                if f.readinto(record) != size:
                    raise ChunkCorrupt(f"{name}: short read")
        except FileNotFoundError:
            raise ChunkMissing(name) from None
        except OSError as e:
            raise ChunkCorrupt(f"{name}: {e}") from e
        return codec.decode(record, name, self._layout)

    def delete(self, name: str) -> None:
        _unlink(self.path(name))

    def clear(self) -> None:
        for entry in os.scandir(self.root):
            if _NAME.match(entry.name):
                _unlink(entry.path)


def scan(root: str, world_size: int) -> dict[str, int]:
    """Chunks on disk for which every rank's file exists: digest -> bytes of one rank's file."""
    ranks: dict[str, dict[int, int]] = {}
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return {}
    for entry in entries:
        m = _NAME.match(entry.name)
        if not m:
            continue
        try:
            size = entry.stat().st_size
        except FileNotFoundError:
            continue
        ranks.setdefault(m.group(1), {})[int(m.group(2))] = size
    return {
        digest: max(sizes.values())
        for digest, sizes in ranks.items()
        if all(r in sizes for r in range(world_size))
    }


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


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
