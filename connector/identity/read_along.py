"""Weight files hashed while vLLM's loader reads them, so the identity costs no second pass.

The scheduler half starts after the workers have loaded the weights and hashes every byte of
them (``checkpoint.fingerprint``): a second read of the whole checkpoint. A ``ReadAlong`` is
started by the worker as its loader opens the files and hashes them beside it, at most
``ahead_bytes`` ahead of the loader's progress (the hash's reads warm the page cache for the
loader, and never run so far ahead that they evict what the loader has yet to read), on
threads that release the GIL (xxhash and ``readinto`` do). When the loader has read every file,
``finish`` waits for the rest of the hash and remembers each digest in the ``DigestCache``,
where the scheduler finds it.

What the digest stands for: each file's version (``file_version``: device, inode, size, mtime,
ctime) is taken before the loader opens it, and again after the loader and the hash are done
with it. Only when the two agree is the digest remembered: the file was not written or replaced
while either read it, so the bytes hashed are the bytes the loader read. Otherwise nothing is
remembered and the scheduler hashes the file as it is then, as without the read-along.

Ranks of one host read the same files: each file version is claimed (``flock``, released when
the process dies) by the first rank to ask and hashed once; the others skip it. No vLLM, no torch.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import weights_digests as wd

logger = logging.getLogger("vllm.kvlens")

AHEAD_BYTES = 2 * wd.SEGMENT_BYTES
THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))  # the loader keeps a core busy too

Claim = Callable[[str], "Callable[[], None] | None"]  # version -> release, or None if taken


@dataclass(frozen=True, slots=True)
class Outcome:
    hashed: int  # files hashed and remembered now
    remembered: int  # files whose digest was remembered already
    claimed_elsewhere: int  # files another rank hashes
    changed: int  # files written or replaced while read: not remembered
    hashed_bytes: int
    waited_s: float  # time ``finish`` waited for the hash after the loader's last read


def natural_order(paths: Sequence[str]) -> list[str]:
    """The order vLLM's iterators read files in (``model-2`` before ``model-10``)."""

    def key(path: str) -> list:
        return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", os.path.basename(path))]

    return sorted(paths, key=key)


def plan_segments(sizes: Sequence[int]) -> list[tuple[int, int, int]]:
    """(file index, segment, offset in the loader's stream) of every segment, in reading order."""
    out, base = [], 0
    for i, size in enumerate(sizes):
        out += [(i, s, base + s * wd.SEGMENT_BYTES) for s in range(wd.segments(size))]
        base += size
    return out


def flock_claims(folder: str) -> Claim:
    """Claims as lock files in ``folder``: whoever holds the lock on a version hashes it."""

    def claim(version: str) -> Callable[[], None] | None:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        path = os.path.join(folder, version.replace(":", "-"))
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None

        def release() -> None:
            try:
                os.unlink(path)
            except OSError:
                pass
            os.close(fd)

        return release

    return claim


class ReadAlong:
    """Hashes ``paths`` beside one loader's pass over them (see the module's docstring).

    ``advance(n)`` after each ``n`` bytes the loader has read; ``finish()`` when it read them all
    (waits for the hash, remembers the digests); ``abort()`` when it stopped early (remembers
    nothing). ``finish`` raises what failed (a read, a stat); the caller logs it, and the
    scheduler hashes what was not remembered. Claims are released either way.
    """

    def __init__(
        self,
        paths: Sequence[str],
        cache: wd.DigestCache,
        claim: Claim,
        *,
        threads: int = THREADS,
        ahead_bytes: int = AHEAD_BYTES,
    ) -> None:
        self._cache = cache
        self._ahead = ahead_bytes
        self._cond = threading.Condition()
        self._progress = 0
        self._stopped = False  # the loader is done (or gave up): no gate any more
        self._aborted = False
        self._releases: list[Callable[[], None]] = []
        self._files: list[tuple[str, os.stat_result]] = []
        self.remembered = self.claimed_elsewhere = 0
        ours, sizes = [], []
        try:
            for path in natural_order(paths):
                st = os.stat(path)
                sizes.append(st.st_size)
                version = wd.file_version(st)
                if cache.get(version) is not None:
                    self.remembered += 1
                    continue
                release = claim(version)
                if release is None:
                    self.claimed_elsewhere += 1
                    continue
                self._releases.append(release)
                ours.append(len(sizes) - 1)
                self._files.append((path, st))
        except BaseException:
            self._release()
            raise
        # Offsets count every file the loader reads, hashed here or not.
        mine = {k: i for i, k in enumerate(ours)}
        self._plan = [(mine[k], seg, off) for k, seg, off in plan_segments(sizes) if k in mine]
        self._next = 0
        self._parts: dict[tuple[int, int], bytes] = {}
        self._read = 0
        self._error: BaseException | None = None
        self._threads = [
            threading.Thread(target=self._run, name=f"kvlens-read-along-{k}", daemon=True)
            for k in range(min(threads, len(self._plan)))
        ]
        for t in self._threads:
            t.start()

    def advance(self, nbytes: int) -> None:
        with self._cond:
            self._progress += nbytes
            self._cond.notify_all()

    def _take(self) -> tuple[int, int] | None:
        with self._cond:
            if self._next >= len(self._plan) or self._aborted:
                return None
            i, seg, offset = self._plan[self._next]
            self._next += 1
            self._cond.wait_for(lambda: self._stopped or offset < self._progress + self._ahead)
            return None if self._aborted else (i, seg)

    def _run(self) -> None:
        try:
            while (job := self._take()) is not None:
                i, seg = job
                part, n = wd.segment_digest(self._files[i][0], seg)
                with self._cond:
                    self._parts[(i, seg)] = part
                    self._read += n
        except BaseException as e:  # noqa: BLE001 - reported by finish()
            with self._cond:
                self._error = e
                self._aborted = True
                self._cond.notify_all()

    def _stop(self, aborted: bool) -> None:
        with self._cond:
            self._stopped = True
            self._aborted = self._aborted or aborted
            self._cond.notify_all()
        for t in self._threads:
            t.join()

    def abort(self) -> None:
        self._stop(aborted=True)
        self._release()

    def finish(self) -> Outcome:
        started = time.perf_counter()
        self._stop(aborted=False)
        waited = time.perf_counter() - started
        hashed = changed = 0
        try:
            if self._error is not None:
                raise self._error
            for i, (path, st) in enumerate(self._files):
                if wd.file_version(os.stat(path)) != wd.file_version(st):
                    changed += 1
                    continue
                parts = [self._parts[(i, seg)] for seg in range(wd.segments(st.st_size))]
                self._cache.put(wd.file_version(st), wd.combine(st.st_size, parts))
                hashed += 1
            if hashed:
                self._cache.save()
        finally:
            self._release()
        return Outcome(hashed, self.remembered, self.claimed_elsewhere, changed, self._read, waited)

    def _release(self) -> None:
        for release in self._releases:
            release()
        self._releases = []
