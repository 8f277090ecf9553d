"""First-chunk marks in the engine's disk directory and Redis prefix (``engine/namespace_marks.py``
says what they are): written and read on one daemon thread, never on the step loop.

The scheduler queues a mark when a request's first chunk is stored to disk or Redis; the
thread merges the marks queued meanwhile into their buckets right away (an engine may be
stopped without its shutdown running: nothing waits to be written), one read and one write
per bucket touched (Redis: two round trips per batch). It reads every bucket, and the
namespace record of each fingerprint it has not seen, once at start and then, while lookups
miss prompts no one stored here, at most every ``READ_S``: a lookup only reads the in-memory
``MarkView``. On disk the buckets are files ``.kvlens-namespaces/marks/<bb>``; in Redis, keys
``<prefix>:nsmark:<bb>`` (with the records' expiry when the tier has one).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from ..engine.namespace_marks import (
    BUCKETS,
    MAX_BUCKET_BYTES,
    Entry,
    MarkView,
    bucket_of,
    decode,
    encode,
    mark_of,
    merge,
    valid_fingerprint,
)
from ..engine.namespace_records import MAX_RECORD_BYTES, NamespaceRecord
from ..tiers import store_records

logger = logging.getLogger("vllm.kvlens")

READ_S = 10.0
MAX_QUEUED = 4096  # marks waiting for the writer (more are dropped: an explanation, not a hit)
MAX_RECORD_READS = 256  # records looked up per read of the marks
MARK_KEY = "nsmark:"


class SharedMarks:
    def __init__(
        self, stores: Callable[[], dict[str, store_records.Store]], ttl_s: Callable[[], int | None]
    ) -> None:
        self.view = MarkView()
        self._stores, self._ttl_s = stores, ttl_s
        self._cond = threading.Condition()
        self._queued: list[Entry] = []
        self._wanted = True  # read once at start
        self._closing = False
        self._records: dict[str, NamespaceRecord] = {}  # records read, by fingerprint
        self._read_at = float("-inf")
        self._warned = False
        self._thread = threading.Thread(target=self._loop, name="kvlens-ns-marks", daemon=True)
        self._thread.start()

    # ---- the scheduler thread -------------------------------------------------------------
    def stored(self, first_chunk: bytes, namespace_fp: str) -> None:
        with self._cond:
            if len(self._queued) < MAX_QUEUED:
                self._queued.append((mark_of(first_chunk), namespace_fp))
                self._cond.notify()

    def wanted(self) -> None:
        """A lookup missed a prompt no namespace here stored: read the marks again when due."""
        if not self._wanted:
            with self._cond:
                self._wanted = True
                self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout=5.0)

    # ---- the thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closing or self._queued or self._due(), timeout=1.0)
                closing, queued, self._queued = self._closing, self._queued, []
                read = self._due()
                if read:
                    self._wanted = False
            if queued:
                self._guard("writing", lambda q=queued: self._write(q))
            if closing:
                return
            if read:
                self._read_at = time.monotonic()
                self._guard("reading", self._read)

    def _due(self) -> bool:
        return self._wanted and time.monotonic() - self._read_at >= READ_S

    def _guard(self, what: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - marks explain misses; they must never stop the engine
            if not self._warned:
                logger.warning("KVLens: %s first-chunk marks failed: %s (said once)", what, e)
                self._warned = True

    def _write(self, entries: list[Entry]) -> None:
        by_bucket: dict[int, list[Entry]] = {}
        for entry in entries:
            by_bucket.setdefault(bucket_of(entry[0]), []).append(entry)
        for store in self._stores().values():
            current = _read_buckets(store, sorted(by_bucket))
            for bucket, new in by_bucket.items():
                _write_bucket(store, bucket, encode(merge(decode(current.get(bucket)), new)), self._ttl_s())

    def _read(self) -> None:
        entries: list[Entry] = []
        stores = self._stores()
        for store in stores.values():
            for raw in _read_buckets(store, range(BUCKETS)).values():
                entries += decode(raw)
        # Every referenced record is read again (one batch per store), so a namespace that was
        # cleared stops explaining misses; past MAX_RECORD_READS, the rest keep what was read.
        referenced = sorted({fp for _, fp in entries if valid_fingerprint(fp)})
        ask = set(referenced[:MAX_RECORD_READS])
        found: dict[str, NamespaceRecord] = {}
        for store in stores.values():
            found.update(_read_records(store, sorted(ask - set(found))))
        self._records = {
            fp: r for fp in referenced if (r := found.get(fp) if fp in ask else self._records.get(fp))
        }
        self.view.replace(entries, self._records)


def _marks_dir(store: store_records.DiskRecords) -> str:
    return os.path.join(store.root, store_records.NAMESPACE_DIR, "marks")


def _read_buckets(store: store_records.Store, buckets: Any) -> dict[int, bytes]:
    buckets = list(buckets)
    out: dict[int, bytes] = {}
    if isinstance(store, store_records.DiskRecords):
        for b in buckets:
            try:
                with open(os.path.join(_marks_dir(store), f"{b:02x}"), "rb") as f:
                    out[b] = f.read(MAX_BUCKET_BYTES + 1)
            except FileNotFoundError:
                pass
        return out
    tier = store.tier
    replies = tier.execute("namespaces", [("GET", tier.key(f"{MARK_KEY}{b:02x}")) for b in buckets])
    for b, reply in zip(buckets, replies, strict=True):
        if isinstance(reply, Exception):
            raise reply
        if reply is not None:
            out[b] = bytes(reply)
    return out


def _write_bucket(store: store_records.Store, bucket: int, raw: bytes, ttl_s: int | None) -> None:
    if isinstance(store, store_records.DiskRecords):
        folder = _marks_dir(store)
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
            os.replace(tmp, os.path.join(folder, f"{bucket:02x}"))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return
    command: tuple[Any, ...] = ("SET", store.tier.key(f"{MARK_KEY}{bucket:02x}"), raw)
    if ttl_s:
        command += ("EX", ttl_s)
    (reply,) = store.tier.execute("namespaces", [command])
    if isinstance(reply, Exception):
        raise reply


def _read_records(store: store_records.Store, fps: list[str]) -> dict[str, NamespaceRecord]:
    """The readable namespace records of these fingerprints (one round trip on Redis)."""
    raws: list[Any] = []
    if isinstance(store, store_records.DiskRecords):
        for fp in fps:
            try:
                with open(os.path.join(store.root, store_records.NAMESPACE_DIR, f"{fp}.json"), "rb") as f:
                    raws.append(f.read(MAX_RECORD_BYTES + 1))
            except OSError:
                raws.append(None)
    elif fps:
        tier = store.tier
        raws = tier.execute("namespaces", [("GET", tier.key(store_records.NAMESPACE_KEY + fp)) for fp in fps])
    out = {}
    for fp, raw in zip(fps, raws, strict=True):
        if raw is None or isinstance(raw, Exception):
            continue
        try:
            record = NamespaceRecord.from_json(bytes(raw))
        except ValueError:
            continue
        if record.fingerprint == fp:
            out[fp] = record
    return out
