"""Whole-file digests of weight files, and a small cache of them that survives restarts.

Every byte of a weight file counts: a file is hashed whole with xxh3-128, in ``SEGMENT_BYTES``
segments (so several threads share one large file), read in large blocks into a reused buffer.
The file's digest is xxh3-128 over its size and its segments' digests.

Hashing 16 GB costs seconds even from the page cache, so the digest is remembered per file
version: keyed by (device, inode, size, mtime, ctime) and ``ALGORITHM``. ctime cannot be set
back by a user, so a file rewritten in place and given its old mtime is hashed again. The
cache is a JSON file (``KVLENS_WEIGHTS_DIGESTS``; default ``~/.cache/kvlens/weights-digests.json``,
``off`` disables it), written atomically, bounded to ``CAPACITY`` files (least recently used
dropped). Whoever can write it can make a changed file pass for the old one: it is trusted
like the checkpoint itself. No vLLM, no torch.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
import threading
import time

import xxhash

logger = logging.getLogger("vllm.kvlens")

ALGORITHM = "xxh3_128/seg1g/v1"  # changes whenever a digest of the same bytes would change
SEGMENT_BYTES = 1 << 30
READ_BYTES = 1 << 20  # one read: the copy stays in the CPU cache for the hash
CAPACITY = 4096  # files remembered
ENV = "KVLENS_WEIGHTS_DIGESTS"

_buffers = threading.local()


def default_cache_path() -> str | None:
    """Where the digests are kept; None when the operator turned the cache off."""
    configured = os.environ.get(ENV)
    if configured is not None:
        return None if configured.strip().lower() in ("", "off", "none", "0") else configured
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvlens", "weights-digests.json")


def file_version(st: os.stat_result) -> str:
    """The cache key of one version of one file (never its path or content)."""
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def segments(size: int) -> int:
    return max(-(-size // SEGMENT_BYTES), 1)


def segment_digest(path: str, index: int) -> tuple[bytes, int]:
    """xxh3-128 of one segment of a file, and the bytes read."""
    buf = getattr(_buffers, "buf", None)
    if buf is None:
        buf = _buffers.buf = bytearray(READ_BYTES)
    view = memoryview(buf)
    h = xxhash.xxh3_128()
    left = SEGMENT_BYTES
    read = 0
    with open(path, "rb", buffering=0) as f:
        f.seek(index * SEGMENT_BYTES)
        while left > 0:
            n = f.readinto(view[: min(left, READ_BYTES)])
            if not n:
                break
            h.update(view[:n])
            read += n
            left -= n
    return h.digest(), read


def combine(size: int, parts: list[bytes]) -> str:
    """A file's digest from its size and its segments' digests, in order."""
    h = xxhash.xxh3_128(f"{size};".encode())
    for part in parts:
        h.update(part)
    return h.hexdigest()


class DigestCache:
    """File digests by file version, loaded once and saved atomically (merged with what
    another process saved meanwhile). Never raises: a cache that cannot be read or written
    only costs a re-hash."""

    def __init__(self, path: str | None, capacity: int = CAPACITY) -> None:
        self.path = path
        self._capacity = capacity
        self._files: dict[str, list] = self._load()
        self._dirty = False

    def _load(self) -> dict[str, list]:
        if not self.path:
            return {}
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            logger.warning("KVLens: ignoring the weights digest cache %s (%s)", self.path, e)
            return {}
        if not isinstance(data, dict) or data.get("algorithm") != ALGORITHM:
            return {}
        files = data.get("files")
        if not isinstance(files, dict):
            return {}
        return {
            k: v
            for k, v in files.items()
            if isinstance(v, list)
            and len(v) == 2
            and isinstance(v[0], str)
            and len(v[0]) == 32
            and isinstance(v[1], int)
        }

    def get(self, version: str) -> str | None:
        entry = self._files.get(version)
        if entry is None:
            return None
        entry[1] = int(time.time())
        self._dirty = True
        return entry[0]

    def put(self, version: str, digest: str) -> None:
        self._files[version] = [digest, int(time.time())]
        self._dirty = True

    def save(self) -> None:
        if not self.path or not self._dirty:
            return
        folder = os.path.dirname(self.path) or "."
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            # Ranks and engines save at once: the lock keeps one's merge from dropping another's.
            with open(self.path + ".lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                merged = self._merged()
                fd, tmp = tempfile.mkstemp(prefix=".weights-digests-", dir=folder)
                try:
                    with os.fdopen(fd, "w", encoding="utf-8") as f:
                        json.dump({"algorithm": ALGORITHM, "files": merged}, f)
                    os.replace(tmp, self.path)
                except BaseException:
                    os.unlink(tmp)
                    raise
        except OSError as e:
            logger.warning("KVLens: cannot save the weights digest cache %s (%s)", self.path, e)
            return
        self._files = merged
        self._dirty = False

    def _merged(self) -> dict[str, list]:
        merged = {**DigestCache(self.path, self._capacity)._files, **self._files}
        if len(merged) > self._capacity:
            newest = sorted(merged.items(), key=lambda kv: kv[1][1], reverse=True)[: self._capacity]
            merged = dict(newest)
        return merged
