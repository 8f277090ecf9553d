"""Receive buffers for remote reads, reused once nothing can read them any more.

A value read into fresh memory costs a page fault per 4 KiB page: here, allocating and touching
a new 4 MiB buffer ran at about 0.5 GB/s, slower than loopback Redis sends it. Reads therefore
land in buffers kept from earlier reads.

Nobody hands a buffer back: the worker copies a loaded chunk into vLLM's KV tensors, a layer-wise
copy thread reads it until the step ends, a promotion may keep it in the CPU tier or queue it for
the disk tier, the CLI may hold it. A buffer is reused only when no view of it is alive anywhere
(no ``memoryview``, no tensor made by ``torch.frombuffer``, which holds one). Python knows that
exactly: a buffer with exported views refuses to change size, so ``_unexported`` asks it to.

Buffers are anonymous memory maps marked for transparent huge pages (``MADV_HUGEPAGE``, where the
kernel has them; ``bytearray`` elsewhere): a batch lands in several buffers, one per value, and
with 4 KiB pages the socket's copy into them ran at about 0.75x its speed into one buffer used
over and over; with huge pages at about 0.9x (8 buffers of 4 MiB, loopback Redis).

Buffers are whole pages (one kept by the CPU tier holds less than a page beyond its record) and
kept per size, at most ``max_bytes`` of them, least recently lent first, so a take usually finds
a free one at once. One still held long after it was lent (kept by the CPU tier, say) is
forgotten rather than looked at again on every take; past ``max_bytes`` a read gets memory of
its own that is freed when its last view goes. Idle, the pool holds at most ``max_bytes``.
"""

from __future__ import annotations

import mmap
import threading
from collections import OrderedDict

SIZE_STEP = 4096  # buffers are whole pages: records of one chunk shape (one size) share them
DEFAULT_MAX_BYTES = 128 * 1024**2


class _Kept:
    __slots__ = ("buffer", "lent_at")

    def __init__(self, buffer: Buffer, lent_at: int) -> None:
        self.buffer = buffer
        self.lent_at = lent_at  # the take that last lent it


class ReadBuffers:
    """Thread-safe: several reader threads take buffers at once."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0  # held by the pool, free or in use
        self._lock = threading.Lock()
        self._kept: OrderedDict[int, _Kept] = OrderedDict()  # least recently lent first
        self._takes = 0

    def take(self, nbytes: int) -> memoryview:
        """A writable view of at least ``nbytes`` that no other live view shares.

        The buffer is in use for as long as this view, or any view or tensor made from it, lives.
        """
        size = -(-nbytes // SIZE_STEP) * SIZE_STEP
        with self._lock:
            self._takes += 1
            for key, kept in list(self._kept.items()):
                if len(kept.buffer) != size:
                    continue
                if _unexported(kept.buffer):
                    return self._lend(key, kept)  # exported before the lock is let go
                if self._takes - kept.lent_at > 2 * len(self._kept):  # held elsewhere for good
                    self._forget(key)
            buffer = _new(size)
            if self._make_room(size):
                key = id(buffer)
                self._kept[key] = _Kept(buffer, self._takes)
                self.bytes += size
            return memoryview(buffer)

    def clear(self) -> None:
        """Forget every buffer (those in use stay valid for their holders)."""
        with self._lock:
            self._kept.clear()
            self.bytes = 0

    def _lend(self, key: int, kept: _Kept) -> memoryview:
        kept.lent_at = self._takes
        self._kept.move_to_end(key)
        return memoryview(kept.buffer)

    def _forget(self, key: int) -> None:
        self.bytes -= len(self._kept.pop(key).buffer)

    def _make_room(self, size: int) -> bool:
        """Forget buffers until ``size`` more fits: free ones first (that frees them), then the
        least recently lent in use (their holders keep them; the pool only stops reusing them)."""
        if size > self.max_bytes:
            return False
        for only_free in (True, False):
            for key, kept in list(self._kept.items()):
                if self.bytes + size <= self.max_bytes:
                    return True
                if not only_free or _unexported(kept.buffer):
                    self._forget(key)
        return self.bytes + size <= self.max_bytes


Buffer = mmap.mmap | bytearray


def _new(size: int) -> Buffer:
    if _MAPPED:
        buffer = mmap.mmap(-1, size)
        if _HUGE is not None:
            buffer.madvise(_HUGE)
        return buffer
    array = bytearray(size + 1)
    del array[-1]  # a spare byte allocated: _unexported's append never moves the buffer
    return array


def _unexported(buffer: Buffer) -> bool:
    """True when no view of ``buffer`` is alive (resizing it is refused otherwise: a map to its
    own size, a bytearray by one byte)."""
    try:
        if isinstance(buffer, mmap.mmap):
            buffer.resize(len(buffer))
        else:
            buffer.append(0)
            del buffer[-1]
    except BufferError:
        return False
    return True


def _maps_work() -> bool:
    """Whether anonymous maps can be resized here (and so tell whether they are viewed)."""
    try:
        probe = mmap.mmap(-1, mmap.PAGESIZE)
        view = memoryview(probe)
        try:
            probe.resize(len(probe))
            return False  # resized under a live view: no way to tell
        except BufferError:
            pass
        view.release()
        probe.resize(len(probe))
        probe.close()
        return True
    except (OSError, ValueError, SystemError, AttributeError):
        return False


_HUGE = getattr(mmap, "MADV_HUGEPAGE", None)
_MAPPED = _maps_work()
