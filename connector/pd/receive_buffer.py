"""The decoder's PD receive buffer: one shared-memory region per TP rank.

The scheduler process owns the region (it creates, allocates, frees and finally removes it); the
worker ranks ``attach`` it by name and read records in place through read-only views. The region
is a file under ``/dev/shm`` (the temp directory where there is none) mapped with ``mmap``: no
resource tracker that would unlink it behind the owner's back, and a crashed owner's file is
recognised by its pid and removed by the next owner on the machine.

**The scheduler never waits for a receiver.** Allocation and free run under the buffer's lock,
each in steps that holes do not lengthen (``slot_allocator``). The index frees with ``free_soon``,
which queues the slots and frees them only if the lock is free now; otherwise whoever holds it
frees them as it lets go (every holder drains the queue after releasing), so space comes back at
once unless a receiver is mid-allocation, and then when it ends.

A transfer's slots are allocated all or nothing: either every chunk gets its slot or none does
(``None``: the buffer is full now), so a half-placed transfer never holds space.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_buffers() -> int:
    """Remove buffers left by owners that died without closing them; how many were removed."""
    removed = 0
    for path in buffer_dir().glob(PREFIX + "*"):
        m = _NAME.match(path.name)
        if m and not _pid_alive(int(m.group(1))):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


class ReceiveBuffer:
    """The owner's side: a writable region, its allocator and its name for the workers."""

    def __init__(self, capacity: int, rank: int) -> None:
        if capacity <= 0:
            raise ValueError("pd_buffer_size must be positive")
        self.name = f"{PREFIX}{os.getpid()}-r{rank}-{secrets.token_hex(6)}"
        self.capacity = capacity
        self._lock = threading.Lock()
        self._allocator = SlotAllocator(capacity)
        self._pending: deque[Slot] = deque()  # freed without waiting; the lock's holder frees them
        path = _path_of(self.name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, capacity)
            self._map = mmap.mmap(fd, capacity)
        finally:
            os.close(fd)
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
        """Unmap and remove the region (views still held elsewhere keep their pages alive)."""
        view, self._view = self._view, None
        if view is not None:
            view.release()
            try:
                self._map.close()
            except BufferError:  # a slot view still held: the mapping goes with its last user
                pass
        _path_of(self.name).unlink(missing_ok=True)


class AttachedBuffer:
    """A worker's read-only mapping of a rank's receive buffer."""

    def __init__(self, name: str) -> None:
        self.name = name
        fd = os.open(_path_of(name), os.O_RDONLY)
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
