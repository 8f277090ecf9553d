"""Faults the soak injects while clients run: damaged and vanished chunk files, a disk folder that
turns read-only for a few seconds, and (with a remote tier) Redis stopped and started again.

Faults hit KVLens's storage from outside, as an operator, a full disk or a crashed Redis would;
every one must cost at most a recompute, never a failed request or a different answer.
"""

from __future__ import annotations

import os
import random
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

CHUNK_SUFFIX = ".kvlens"


def chunk_files(folder: Path) -> list[Path]:
    """Chunk files in their subdirectories (and any left in the flat layout of older versions)."""
    try:
        return [*folder.glob("*" + CHUNK_SUFFIX), *folder.glob("*/*" + CHUNK_SUFFIX)]
    except OSError:
        return []


def corrupt(path: Path, rng: random.Random) -> bool:
    """Flip bytes in place (past the header, so the checksum is what notices) or truncate."""
    try:
        size = path.stat().st_size
        with open(path, "r+b") as f:
            if rng.random() < 0.3:
                f.truncate(size // 2)
            else:
                f.seek(rng.randrange(size // 2, size - 8))
                data = f.read(8)
                f.seek(-len(data), os.SEEK_CUR)
                f.write(bytes(b ^ 0xFF for b in data))
        return True
    except (OSError, ValueError):  # KVLens deleted or replaced it meanwhile
        return False


class ReadOnlyFolder:
    """Makes a folder refuse new, renamed and deleted entries, and undoes it.

    ``chmod`` does not stop root, so as root the folder is made immutable (``chattr +i``, which
    root obeys); elsewhere it is ``chmod 0555``.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._mode = folder.stat().st_mode & 0o7777
        self._chattr = os.geteuid() == 0

    def __enter__(self) -> ReadOnlyFolder:
        if self._chattr:
            subprocess.run(["chattr", "+i", str(self.folder)], check=True, capture_output=True)
        else:
            os.chmod(self.folder, 0o555)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._chattr:
            subprocess.run(["chattr", "-i", str(self.folder)], check=False, capture_output=True)
        os.chmod(self.folder, self._mode)


class Chaos(threading.Thread):
    """Injects one file fault every ``interval_s``, the read-only spell once at 35% of the run,
    and ``restart_remote`` (if given) once at 60%. ``faults`` counts what was done."""

    def __init__(
        self,
        disk: Path,
        duration_s: float,
        seed: int = 0,
        interval_s: float = 0.4,
        read_only_s: float = 3.0,
        restart_remote: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(name="soak-chaos", daemon=True)
        self.disk = disk
        self.duration_s = duration_s
        self.interval_s = interval_s
        self.read_only_s = read_only_s
        self.restart_remote = restart_remote
        self.faults: Counter[str] = Counter()
        self.errors: list[str] = []
        self._rng = random.Random(seed)
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(timeout=60)

    def run(self) -> None:
        start = time.monotonic()
        read_only_done = remote_done = False
        try:
            while not self._halt.wait(self.interval_s):
                elapsed = (time.monotonic() - start) / self.duration_s
                if elapsed >= 1:
                    return
                if not read_only_done and elapsed >= 0.35:
                    read_only_done = True
                    with ReadOnlyFolder(self.disk):
                        self.faults["read_only_folder"] += 1
                        self._halt.wait(self.read_only_s)
                    continue
                if self.restart_remote and not remote_done and elapsed >= 0.6:
                    remote_done = True
                    self.restart_remote()
                    self.faults["remote_restart"] += 1
                    continue
                self._damage_one()
        except Exception as e:  # a fault that could not be injected is a result, not a crash
            self.errors.append(repr(e))

    def _damage_one(self) -> None:
        files = chunk_files(self.disk)
        if not files:
            return
        path = self._rng.choice(files)
        if self._rng.random() < 0.5:
            try:
                path.unlink()
                self.faults["deleted_chunk"] += 1
            except OSError:
                pass
        elif corrupt(path, self._rng):
            self.faults["corrupted_chunk"] += 1
