"""Disk records read a layer at a time, every record's layer 0 first.

The forward pass needs layer 0 of every chunk a request loads before its first layer, and layer
N only before layer N. ``LayeredReads`` opens a load's records and checks their headers (one
task), then reads layer 0 of every record, then layer 1 of every record, and so on (a task per
layer, run in that order on the tier's reader threads), each layer checked against its own
checksum (the record's ``lx``) before anyone may copy it. Copying layer N (``wait_layer``)
thus overlaps reading the layers after it, and a bit flipped in the last layer is caught before
that layer is copied, never after.

A record written without per-layer checksums (older versions) is read and checked whole by the
header task. A record that fails (missing, a damaged header, a short read, a layer's checksum)
fails from that layer on, and whoever waits for it gets the error. Every wait is bounded by a
deadline set when the reads were submitted: a hung disk costs failed blocks, never a hung step.
The payloads land in buffers of the tier's pool (``read_buffers.py``): no page faults per load.

Straight into the KV cache: where the consumer hands a record's destinations (``Targets``: per
layer, the runs of vLLM's host KV blocks the whole layer goes to), its layers are read into them
directly and checked there, one memory copy instead of two. A read into the KV cache never waits
for the device: it asks for what is in the page cache (``RWF_NOWAIT``); a layer that is not is
read into a pool buffer first (that read may block) and copied in once checked. A layer read in
place that fails its check, or was read only in part, is zeroed before anything may read it:
vLLM reuses a block without clearing it and its attention kernels read a block's unused slots
too, so the random bytes of a damaged record (NaNs, as bf16) left there would poison the answer
of whichever request gets the block next. Only checked KV or zeros stay in vLLM's blocks. Each
write into the KV cache starts only while the reads are open (and, for its record, while the
consumer has not given it up at ``payload``), and ``close`` waits for those under way, so once
the consumer is done with a load (finished, failed, timed out, cancelled) or loads a chunk from
another tier instead, nothing of this record writes into vLLM's blocks again.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import codec
from .base import ChunkCorrupt

# Per layer of a record, (byte offset within the layer, writable bytes of vLLM's KV cache) for
# every run of its blocks, covering the whole layer in order.
Targets = Sequence[Sequence[tuple[int, memoryview]]]


_FIRST_READ_BYTES = 2048  # a record's first read: its whole header, unless the model has many layers


class ReadsClosed(RuntimeError):
    """The consumer was done with the load before this read wrote into the KV cache."""


if TYPE_CHECKING:
    from .disk import DiskTier


@dataclass(eq=False)
class _Record:
    name: str
    fd: int = -1
    path: str = ""
    inode: int = 0
    mtime_ns: int = 0
    header: codec.CheckedHeader | None = None
    payload: memoryview | None = None  # filled a layer at a time (None: read into ``targets``)
    offered: Targets | None = None  # where the consumer would have its layers go in the KV cache
    targets: Targets | None = None  # ``offered``, if its layers are read straight there
    error: BaseException | None = None
    failed_from: int = 0  # the first layer not to use, once ``error`` is set
    unopened: bool = False  # failed before any layer was read (missing, damaged header)
    given_up: bool = False  # the consumer will not use it: nothing of it goes into the KV cache


class LayeredReads:
    """The reads of one load's records on one disk tier. Reader threads run ``open_all`` and
    then ``read_layer(0)``, ``read_layer(1)``...; consumers call ``payload`` and ``wait_layer``."""

    def __init__(
        self,
        tier: DiskTier,
        names: Sequence[str],
        num_layers: int,
        timeout_s: float,
        before: Sequence[threading.Event] = (),
        on_done: Callable[[float, float, int], None] | None = None,
        targets: Sequence[Targets | None] = (),
    ) -> None:
        self._tier = tier
        offered = list(targets) or [None] * len(names)
        self._records = [_Record(name, offered=t) for name, t in zip(names, offered, strict=True)]
        self._num_layers = num_layers
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s
        self._before = before  # queued writes of these names: read what they write
        self._on_done = on_done  # (began, ended, bytes read) once every layer is read
        self._opened = threading.Event()
        self._layers = [threading.Event() for _ in range(num_layers)]
        self._lock = threading.Lock()
        self._left = num_layers  # layer tasks still to finish: the last one closes the files
        self._began = 0.0
        self._bytes = 0
        self._closed = False  # the consumer is done: nothing writes into the KV cache any more
        self._writing = 0  # writes into the KV cache under way
        self._written = threading.Condition(self._lock)

    # ---- on the tier's reader threads ---------------------------------------------------
    def open_all(self) -> None:
        try:
            for write in self._before:
                write.wait()
            self._began = time.perf_counter()
            for record in self._records:
                try:
                    self._open(record)
                except Exception as e:  # noqa: BLE001 - this record fails; the others go on
                    record.unopened = True
                    self._fail(record, e, 0)
        finally:
            self._opened.set()

    def read_layer(self, layer: int) -> None:
        try:
            self._opened.wait()
            for record in self._records:
                if self._closed:
                    break
                if record.error is None and record.header is not None and record.header.layers:
                    try:
                        self._read(record, layer)
                    except Exception as e:  # noqa: BLE001
                        with self._lock:
                            self._fail(record, e, layer)
        finally:
            self._layer_done()  # before the event: a load that waited for every layer is counted
            self._layers[layer].set()

    # ---- consumers ----------------------------------------------------------------------
    def record(self, index: int) -> LayeredRecord:
        return LayeredRecord(self, index)

    def payload(self, index: int) -> memoryview | BaseException | None:
        """Record ``index``'s payload buffer once its header is checked (its layers fill in
        later: ``wait_layer``); None when its layers go straight into its targets; or why it
        cannot be read at all. A layer that fails later, even layer 0, fails in ``wait_layer``,
        never here: the consumer must not load the chunk from elsewhere into blocks a read of
        this record may still be writing. Once this returns why not, no read of this record
        writes into the KV cache (one under way is waited for): the consumer may load the chunk
        from elsewhere into the same blocks."""
        record = self._records[index]
        if not self._opened.wait(max(self._deadline - time.monotonic(), 0.0)):
            self._give_up(record)
            return TimeoutError(f"disk read took over {self._timeout_s:g} s")
        if record.unopened:
            self._give_up(record)
            return record.error  # type: ignore[return-value]
        return record.payload

    def _give_up(self, record: _Record) -> None:
        with self._lock:
            record.given_up = True
            while self._writing:
                self._written.wait()

    def close(self) -> None:
        """The consumer is done with these reads: returns once nothing writes into the KV cache
        any more (a write under way is a copy from memory; none starts after this)."""
        with self._lock:
            self._closed = True
            while self._writing:
                self._written.wait()

    def wait_layer(self, index: int, layer: int) -> None:
        """Returns once layer ``layer`` of record ``index`` is read and checked; raises why not."""
        for i in range(layer + 1):
            if not self._layers[i].wait(max(self._deadline - time.monotonic(), 0.0)):
                raise TimeoutError(f"disk read took over {self._timeout_s:g} s")
        record = self._records[index]
        if record.error is not None and record.failed_from <= layer:
            raise record.error

    # ---- internals ----------------------------------------------------------------------
    def _open(self, record: _Record) -> None:
        tier = self._tier
        fd, path = tier.open_record(record.name)
        record.fd, record.path = fd, path
        st = os.fstat(fd)
        record.inode, record.mtime_ns = st.st_ino, st.st_mtime_ns
        prefix = os.pread(fd, _FIRST_READ_BYTES, 0)
        if len(prefix) == _FIRST_READ_BYTES and codec.header_length(prefix) > len(prefix):
            whole = min(codec.header_length(prefix), codec.HEADER_PEEK_BYTES)  # longer: corrupt
            prefix += os.pread(fd, whole - len(prefix), len(prefix))
        header = codec.check_header(prefix, record.name, tier.layout, tier.trust)
        if st.st_size != header.end + header.nbytes:
            expected = header.end + header.nbytes
            raise ChunkCorrupt(f"{record.name}: record is {st.st_size} bytes, its header says {expected}")
        if header.layers is not None and len(header.layers) != self._num_layers:
            counts = f"{len(header.layers)} layer checksums, the KV has {self._num_layers} layers"
            raise ChunkCorrupt(f"{record.name}: {counts}")
        record.header = header
        if record.offered is not None and header.layers is not None and _covers(record.offered, header):
            record.targets = record.offered  # every layer goes straight into the KV cache
            return
        record.payload = tier.read_buffers.take(header.nbytes)[: header.nbytes]
        if header.layers is None:  # an older record: read and checked whole, here
            _read_exactly(fd, record.payload, header.end, record.name)
            if header.digests.whole(record.payload) != header.whole:
                raise ChunkCorrupt(f"{record.name}: checksum mismatch")
            self._bytes += header.nbytes

    def _read(self, record: _Record, layer: int) -> None:
        header = record.header
        assert header is not None and header.layers is not None
        size = header.nbytes // len(header.layers)
        if record.targets is not None:
            self._read_into_kv(record, layer, size)
            return
        assert record.payload is not None
        view = record.payload[layer * size : (layer + 1) * size]
        _read_exactly(record.fd, view, header.end + layer * size, record.name)
        if header.digests.layer(view) != header.layers[layer]:
            raise ChunkCorrupt(f"{record.name}: checksum mismatch in layer {layer}")
        with self._lock:
            self._bytes += size

    def _read_into_kv(self, record: _Record, layer: int, size: int) -> None:
        header, runs = record.header, record.targets[layer]  # type: ignore[index]
        assert header is not None and header.layers is not None
        offset = header.end + layer * size
        cached = good = False
        tried = self._tier.reads_nowait
        with self._writing_into_kv(record):
            try:
                cached = tried and _read_cached(record.fd, runs, offset, self._tier)
                good = cached and header.digests.layer_of(view for _, view in runs) == header.layers[layer]
            finally:
                if tried and not good:  # bytes read but not checked good (or not whole): none stays
                    _zero(runs)
        if not cached:  # not all in the page cache: through a buffer, then in once checked
            bounce = self._tier.read_buffers.take(size)[:size]
            _read_exactly(record.fd, bounce, offset, record.name)
            good = header.digests.layer(bounce) == header.layers[layer]
            if good:
                with self._writing_into_kv(record):
                    for start, view in runs:
                        view[:] = bounce[start : start + view.nbytes]
        if not good:
            raise ChunkCorrupt(f"{record.name}: checksum mismatch in layer {layer}")
        with self._lock:
            self._bytes += size

    @contextlib.contextmanager
    def _writing_into_kv(self, record: _Record) -> Iterator[None]:
        with self._lock:
            if self._closed or record.given_up:
                raise ReadsClosed("the load was given up before this layer was read")
            self._writing += 1
        try:
            yield
        finally:
            with self._lock:
                self._writing -= 1
                if not self._writing:
                    self._written.notify_all()

    def _fail(self, record: _Record, error: BaseException, layer: int) -> None:
        if record.error is not None and record.failed_from <= layer:
            return
        record.error, record.failed_from = error, layer
        if isinstance(error, ChunkCorrupt) and record.path:
            self._tier.remove_if_corrupt(record.path, record.inode, record.mtime_ns)

    def _layer_done(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if not last:
            return
        for record in self._records:
            if record.fd >= 0:
                os.close(record.fd)
                record.fd = -1
        if self._on_done is not None and self._bytes:
            self._on_done(self._began, time.perf_counter(), self._bytes)


@dataclass(frozen=True, slots=True)
class LayeredRecord:
    """One record of a ``LayeredReads``: what a load of that chunk waits on."""

    reads: LayeredReads
    index: int

    def payload(self) -> memoryview | BaseException:
        return self.reads.payload(self.index)

    def wait_layer(self, layer: int) -> None:
        self.reads.wait_layer(self.index, layer)


def _covers(targets: Targets, header: codec.CheckedHeader) -> bool:
    """Whether there are runs for every layer and each layer's cover it whole, in order."""
    layers = header.layers or ()
    if len(targets) != len(layers):
        return False
    layer_bytes = header.nbytes // len(layers)
    for runs in targets:
        at = 0
        for start, view in runs:
            if start != at:
                return False
            at += view.nbytes
        if at != layer_bytes:
            return False
    return True


def _read_cached(fd: int, runs: Sequence[tuple[int, memoryview]], offset: int, tier: DiskTier) -> bool:
    """Read the runs from what the page cache holds, never waiting for the device; False when
    it does not hold them all (what was read is read again, through a buffer)."""
    for start, view in runs:
        try:
            n = os.preadv(fd, [view], offset + start, os.RWF_NOWAIT)
        except BlockingIOError:
            return False
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a file system without it
                tier.reads_nowait = False
                return False
            raise
        if n != view.nbytes:
            return False
    return True


def _zero(runs: Sequence[tuple[int, memoryview]]) -> None:
    """Clear runs of vLLM's blocks a read wrote unchecked bytes into: vLLM reuses blocks
    without clearing them and its attention kernels read a block's unused slots (masked, but
    a NaN there still poisons the result), so only checked KV or zeros may stay in them."""
    for _, view in runs:
        view[:] = bytes(view.nbytes)


def _read_exactly(fd: int, view: memoryview, offset: int, name: str) -> None:
    done = 0
    while done < view.nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise ChunkCorrupt(f"{name}: short read")
        done += n
