"""The failed-load event log: one JSON object per line, appended, rotated at a size limit.
``EventLog`` is the writer for every KVLens JSON-lines log (the per-request log uses it too) and
``read_events`` the reader.

Each line is written with a single ``write`` on a file opened with ``O_APPEND``, so a reader
(the dashboard, ``tail -f``) never sees half a line, and several processes can append to the
same file. When the file would pass ``max_bytes`` it is renamed to ``<file>.1`` (older ones
shift to ``.2`` ...) under an exclusive lock, and a new file starts; a reader that follows the
file should reopen it when its inode changes. Writing never raises into the engine.

The log is private: its directory is created 0700, the file 0600, and neither the file nor the
rotation lock is opened through a symbolic link, so another local user can neither read the
events nor redirect the writes.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("vllm.kvlens")

LOAD_FAILED = "load_failed"


def load_failed_event(
    request_id: str,
    tiers: Sequence[str],
    block_ids: Sequence[int],
    tokens_affected: int,
    reason: str,
    recomputed: bool,
    engine: str,
    model: str,
) -> dict[str, Any]:
    now = time.time()
    return {
        "time": dt.datetime.fromtimestamp(now, dt.timezone.utc).isoformat(timespec="milliseconds"),
        "ts": round(now, 6),
        "event": LOAD_FAILED,
        "request_id": request_id,
        "tier": tiers[0] if tiers else None,
        "tiers": list(tiers),
        "block_ids": sorted(block_ids),
        "num_blocks": len(block_ids),
        "tokens_affected": tokens_affected,
        "reason": reason,
        "recomputed": recomputed,
        "engine": engine,
        "model": model,
    }


class EventLog:
    def __init__(
        self, path: str, max_bytes: int = 10 * 1024 * 1024, backups: int = 3, name: str = "event log"
    ) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = max(backups, 1)
        self.name = name  # what the one warning calls this log
        self._lock = threading.Lock()
        self._warned = False

    def append(self, event: dict[str, Any]) -> bool:
        # default=str: an odd value (an enum, a path) is written as text instead of raising
        line = (json.dumps(event, separators=(",", ":"), default=str) + "\n").encode()
        try:
            with self._lock:
                _private_dir(os.path.dirname(self.path) or ".")
                self._rotate_if_needed(len(line))
                fd = os.open(self.path, _WRITE_FLAGS | os.O_APPEND, 0o600)
                try:
                    os.write(fd, line)
                finally:
                    os.close(fd)
            return True
        except OSError as e:
            if not self._warned:
                self._warned = True
                logger.warning("KVLens: cannot write %s %s: %s", self.name, self.path, e)
            return False

    def _rotate_if_needed(self, incoming: int) -> None:
        if _size(self.path) + incoming <= self.max_bytes:
            return
        lock_fd = os.open(self.path + ".lock", _WRITE_FLAGS, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            if _size(self.path) + incoming <= self.max_bytes:
                return  # another process rotated meanwhile
            for i in range(self.backups - 1, 0, -1):
                older = f"{self.path}.{i}"
                if os.path.exists(older):
                    os.replace(older, f"{self.path}.{i + 1}")
            if os.path.exists(self.path):
                os.replace(self.path, f"{self.path}.1")
        finally:
            os.close(lock_fd)  # releases the flock


_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _private_dir(path: str) -> None:
    """Create the log's directory 0700; refuse one that another user owns."""
    if not os.path.isdir(path):
        os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to another user")


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


@dataclass(slots=True)
class ReadCounts:
    """What ``read_events`` saw: objects read, and lines skipped as torn or not a JSON object."""

    read: int = 0
    skipped: int = 0


def read_events(
    path: str, include_rotated: bool = True, counts: ReadCounts | None = None
) -> Iterator[dict[str, Any]]:
    """Objects oldest first, from the rotated files (``.N`` ... ``.1``) and then the live one.

    A torn or garbage line (a crash, another writer, a disk that broke) is skipped and counted in
    ``counts``, so one bad line never hides the rest of the log."""
    counts = ReadCounts() if counts is None else counts
    paths = [path]
    if include_rotated:
        i = 1
        while os.path.exists(f"{path}.{i}"):
            paths.insert(0, f"{path}.{i}")
            i += 1
    for p in paths:
        try:
            with open(p, encoding="utf-8", errors="replace") as f:
                for line in f:
                    record = _parse(line)
                    if record is None:
                        counts.skipped += 1 if line.strip() else 0
                        continue
                    counts.read += 1
                    yield record
        except FileNotFoundError:
            continue


def _parse(line: str) -> dict[str, Any] | None:
    if not line.endswith("\n"):
        return None  # cut short (one write per line makes this a crash, not a writer mid-line)
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None
