"""The decoder's PD receive buffer: one shared-memory region per TP rank.

The scheduler process owns the region (it creates, allocates, frees and finally removes it); the
worker ranks ``attach`` it by name and read records in place through read-only views. The region
is a file under ``/dev/shm`` (the temp directory where there is none) mapped with ``mmap``: no
resource tracker that would unlink it behind the owner's back, and a crashed owner's file is
recognised by its pid and removed by the next owner on the machine.

A transfer's slots are allocated all or nothing: either every chunk gets its slot or none does
(``None``: the buffer is full now), so a half-placed transfer never holds space.
"""

from __future__ import annotations

import bisect
import mmap
import os
import re
import secrets
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ALIGN = 64  # each slot starts on a cache line
PREFIX = "kvlens-pd-"
_NAME = re.compile(r"^kvlens-pd-(\d+)-r(\d+)-[0-9a-f]{12}$")


def buffer_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _path_of(name: str) -> Path:
    if not _NAME.match(name):
        raise ValueError(f"not a PD receive buffer name: {name!r}")
    return buffer_dir() / name


@dataclass(frozen=True, slots=True)
class Slot:
    offset: int
    length: int  # the record's bytes (the space taken is rounded up to ALIGN)


def _span(length: int) -> int:
    return max(ALIGN, -(-length // ALIGN) * ALIGN)


def space_needed(lengths: Sequence[int]) -> int:
    """Bytes of the buffer that slots of these lengths take (each rounded up to ALIGN)."""
    return sum(_span(n) for n in lengths)


class SlotAllocator:
    """First fit over a sorted list of free extents, coalesced on free. Not thread-safe."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._starts: list[int] = [0] if capacity else []
        self._ends: list[int] = [capacity] if capacity else []
        self.used = 0

    def allocate_all(self, lengths: Sequence[int]) -> list[Slot] | None:
        """A slot per length, or ``None`` (and nothing held) when they do not all fit now."""
        if space_needed(lengths) > self.capacity - self.used:
            return None
        slots: list[Slot] = []
        for n in lengths:
            slot = self._take(n)
            if slot is None:
                for s in slots:
                    self.free(s)
                return None
            slots.append(slot)
        return slots

    def _take(self, length: int) -> Slot | None:
        need = _span(length)
        for i, (start, end) in enumerate(zip(self._starts, self._ends, strict=True)):
            if end - start >= need:
                if end - start == need:
                    del self._starts[i], self._ends[i]
                else:
                    self._starts[i] = start + need
                self.used += need
                return Slot(start, length)
        return None

    def free(self, slot: Slot) -> None:
        start, end = slot.offset, slot.offset + _span(slot.length)
        i = bisect.bisect_left(self._starts, start)
        if (i < len(self._starts) and self._starts[i] < end) or (i and self._ends[i - 1] > start):
            raise ValueError(f"slot {slot} freed twice")
        self.used -= end - start
        if i < len(self._starts) and self._starts[i] == end:
            end = self._ends[i]
            del self._starts[i], self._ends[i]
        if i and self._ends[i - 1] == start:
            self._ends[i - 1] = end
        else:
            self._starts.insert(i, start)
            self._ends.insert(i, end)


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
        return self._allocator.used

    def allocate_all(self, lengths: Sequence[int]) -> list[Slot] | None:
        with self._lock:
            return self._allocator.allocate_all(lengths)

    def free(self, slot: Slot) -> None:
        with self._lock:
            self._allocator.free(slot)

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
