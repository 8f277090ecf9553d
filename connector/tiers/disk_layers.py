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
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import codec
from .base import ChunkCorrupt

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
    payload: memoryview | None = None  # filled a layer at a time
    error: BaseException | None = None
    failed_from: int = 0  # the first layer not to use, once ``error`` is set


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
    ) -> None:
        self._tier = tier
        self._records = [_Record(name) for name in names]
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
                    self._fail(record, e, 0)
        finally:
            self._opened.set()

    def read_layer(self, layer: int) -> None:
        try:
            self._opened.wait()
            for record in self._records:
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

    def payload(self, index: int) -> memoryview | BaseException:
        """Record ``index``'s payload buffer once its header is checked (its layers fill in
        later: ``wait_layer``), or why it cannot be read."""
        if not self._opened.wait(max(self._deadline - time.monotonic(), 0.0)):
            return TimeoutError(f"disk read took over {self._timeout_s:g} s")
        record = self._records[index]
        if record.error is not None and record.failed_from == 0:
            return record.error
        assert record.payload is not None
        return record.payload

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
        prefix = os.pread(fd, codec.HEADER_PEEK_BYTES, 0)
        header = codec.check_header(prefix, record.name, tier.layout)
        if st.st_size != header.end + header.nbytes:
            expected = header.end + header.nbytes
            raise ChunkCorrupt(f"{record.name}: record is {st.st_size} bytes, its header says {expected}")
        if header.layers is not None and len(header.layers) != self._num_layers:
            counts = f"{len(header.layers)} layer checksums, the KV has {self._num_layers} layers"
            raise ChunkCorrupt(f"{record.name}: {counts}")
        record.header = header
        record.payload = tier.read_buffers.take(header.nbytes)[: header.nbytes]
        if header.layers is None:  # an older record: read and checked whole, here
            _read_exactly(fd, record.payload, header.end, record.name)
            if codec.checksum(record.payload) != header.whole:
                raise ChunkCorrupt(f"{record.name}: checksum mismatch")
            self._bytes += header.nbytes

    def _read(self, record: _Record, layer: int) -> None:
        header = record.header
        assert header is not None and header.layers is not None and record.payload is not None
        size = header.nbytes // len(header.layers)
        view = record.payload[layer * size : (layer + 1) * size]
        _read_exactly(record.fd, view, header.end + layer * size, record.name)
        if codec.layer_checksum(view) != header.layers[layer]:
            raise ChunkCorrupt(f"{record.name}: checksum mismatch in layer {layer}")
        with self._lock:
            self._bytes += size

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


def _read_exactly(fd: int, view: memoryview, offset: int, name: str) -> None:
    done = 0
    while done < view.nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise ChunkCorrupt(f"{name}: short read")
        done += n
