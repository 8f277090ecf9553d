"""The decoder's PD receive buffer: one shared-memory region per TP rank.

The scheduler process owns the region (it creates, allocates, frees and finally removes it); the
worker ranks ``attach`` it by name and read records in place through read-only views. The region
is a file under ``/dev/shm`` (the temp directory where there is none) mapped with ``mmap``: no
resource tracker that would unlink it behind the owner's back.

**Alive is a lock, not a pid.** The owner holds an exclusive ``flock`` on its file from before
the name appears until ``close`` removes it; the kernel lets go when the owner dies, however it
dies. ``remove_stale_buffers`` removes only files nobody holds, that are regular files (a planted
symlink is never followed) and belong to this user. The pid in the name cannot tell: a live
decoder in another PID namespace sharing ``/dev/shm`` (``docker --ipc=host``) looks dead, pids
are reused, and a planted name may hold anything. Workers open read-only and take no lock, so an
attach neither keeps a dead owner's file nor makes a live one look dead. The name keeps its
format (``kvlens-pd-<pid>-r<rank>-<random>``): files of older versions, which hold no lock, are
recognised and count as stale. Clean-up never raises: a file it cannot judge stays, logged.

**The scheduler never waits for a receiver.** Allocation and free run under the buffer's lock,
each in steps that holes do not lengthen (``slot_allocator``). The index frees with ``free_soon``,
which queues the slots and frees them only if the lock is free now; otherwise whoever holds it
frees them as it lets go (every holder drains the queue after releasing), so space comes back at
once unless a receiver is mid-allocation, and then when it ends.

A transfer's slots are allocated all or nothing: either every chunk gets its slot or none does
(``None``: the buffer is full now), so a half-placed transfer never holds space.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import tempfile
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from .slot_allocator import ALIGN, Slot, SlotAllocator, space_needed

__all__ = [
    "ALIGN",
    "PREFIX",
    "AttachedBuffer",
    "ReceiveBuffer",
    "Slot",
    "SlotAllocator",
    "attach",
    "buffer_dir",
    "remove_stale_buffers",
    "space_needed",
]

log = logging.getLogger(__name__)

PREFIX = "kvlens-pd-"
_NAME = re.compile(r"^kvlens-pd-(\d+)-r(\d+)-[0-9a-f]{12}$")


def buffer_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _path_of(name: str) -> Path:
    if not _NAME.match(name):
        raise ValueError(f"not a PD receive buffer name: {name!r}")
    return buffer_dir() / name


def _create_locked(path: Path) -> int:
    """A new file at ``path``, locked before its name appears: a clean-up running meanwhile never
    finds it unlocked. It is made under a name clean-up ignores, then linked (never replacing)."""
    hidden = path.with_name(f".{path.name}.new")
    fd = os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.link(hidden, path)
    except BaseException:
        os.close(fd)
        raise
    finally:
        hidden.unlink(missing_ok=True)
    return fd


def remove_stale_buffers() -> int:
    """Remove buffers nobody holds (their owner died without closing them); how many.

    Never raises: a decoder starts whatever lies in the directory."""
    try:
        names = [e.name for e in os.scandir(buffer_dir()) if _NAME.match(e.name)]
    except OSError as e:
        log.warning("PD receive buffers: cannot list %s for stale ones: %s", buffer_dir(), e)
        return 0
    removed = 0
    for name in names:
        path = buffer_dir() / name
        try:
            removed += _remove_if_stale(path)
        except FileNotFoundError:  # closed by its owner, or removed by another clean-up, meanwhile
            pass
        except Exception as e:  # noqa: BLE001 - whatever a planted file does, the decoder starts
            log.warning("PD receive buffer %s left in place: %s", path, e)
    if removed:
        log.info("PD receive buffers: removed %d left by owners that are gone", removed)
    return removed


def _remove_if_stale(path: Path) -> bool:
    """Remove ``path`` if it is this user's regular file and nobody holds its lock."""
    if not _ours(os.lstat(path)):
        log.debug("PD receive buffer %s: not this user's regular file, left alone", path)
        return False
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        opened = os.fstat(fd)
        if not _ours(opened):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its owner holds it
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) != (opened.st_dev, opened.st_ino):
            return False  # replaced since it was opened
        os.unlink(path)
        return True
    finally:
        os.close(fd)


def _ours(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


class ReceiveBuffer:
    """The owner's side: a writable region, its allocator, its lock file and its name."""

    def __init__(self, capacity: int, rank: int) -> None:
        if capacity <= 0:
            raise ValueError("pd_buffer_size must be positive")
        self.name = f"{PREFIX}{os.getpid()}-r{rank}-{secrets.token_hex(6)}"
        self.capacity = capacity
        self._lock = threading.Lock()
        self._allocator = SlotAllocator(capacity)
        self._pending: deque[Slot] = deque()  # freed without waiting; the lock's holder frees them
        path = _path_of(self.name)
        self._fd = _create_locked(path)  # held open, and locked, until close()
        try:
            os.ftruncate(self._fd, capacity)
            self._map = mmap.mmap(self._fd, capacity)
        except BaseException:
            path.unlink(missing_ok=True)
            os.close(self._fd)
            raise
        self._view: memoryview | None = memoryview(self._map)

    @property
    def used_bytes(self) -> int:
        """Bytes in slots, with those ``free_soon`` queued that the lock's holder has yet to free."""
        return self._allocator.used

    def allocate_all(self, lengths: Sequence[int]) -> list[Slot] | None:
        with self._holding():
            return self._allocator.allocate_all(lengths)

    def free(self, slot: Slot) -> None:
        """Give a slot back now, waiting for the lock (a receiver thread freeing its own slots)."""
        with self._holding():
            self._allocator.free(slot)

    def free_soon(self, slots: Iterable[Slot]) -> None:
        """Give slots back without ever waiting: freed now if the lock is free, else by its holder."""
        self._pending.extend(slots)
        self._settle()

    @contextmanager
    def _holding(self) -> Iterator[None]:
        try:
            with self._lock:
                self._free_pending()
                yield
        finally:
            self._settle()

    def _settle(self) -> None:
        """Free what is queued unless another thread holds the lock: that thread settles after."""
        while self._pending and self._lock.acquire(blocking=False):
            try:
                self._free_pending()
            finally:
                self._lock.release()

    def _free_pending(self) -> None:
        while self._pending:
            slot = self._pending.popleft()  # only the lock's holder takes from the queue
            try:
                self._allocator.free(slot)
            except ValueError as e:  # a defect; raising here would fail an unrelated transfer
                log.error("PD receive buffer %s: %s", self.name, e)

    def writable(self, slot: Slot) -> memoryview:
        if self._view is None:
            raise ValueError("receive buffer closed")
        return self._view[slot.offset : slot.offset + slot.length]

    def close(self) -> None:
        """Unmap and remove the region (views still held elsewhere keep their pages alive), then
        let go of the lock: the name is gone before anyone could take the file for stale."""
        view, self._view = self._view, None
        if view is not None:
            view.release()
            try:
                self._map.close()
            except BufferError:  # a slot view still held: the mapping goes with its last user
                pass
        _path_of(self.name).unlink(missing_ok=True)
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


class AttachedBuffer:
    """A worker's read-only mapping of a rank's receive buffer (it takes no lock: see above)."""

    def __init__(self, name: str) -> None:
        self.name = name
        fd = os.open(_path_of(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._view: memoryview | None = memoryview(self._map)

    def view(self, offset: int, length: int) -> memoryview:
        """The record at ``offset`` (read-only); ``ValueError`` outside the region."""
        if self._view is None:
            raise ValueError("attached buffer closed")
        if offset < 0 or length < 0 or offset + length > len(self._view):
            raise ValueError(f"record [{offset}, {offset + length}) outside the buffer")
        return self._view[offset : offset + length]

    def close(self) -> None:
        view, self._view = self._view, None
        if view is not None:
            view.release()
            try:
                self._map.close()
            except BufferError:
                pass


def attach(name: str) -> AttachedBuffer:
    return AttachedBuffer(name)
