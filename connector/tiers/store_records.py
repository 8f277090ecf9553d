"""Chunk and namespace records in a disk directory or under a Redis key prefix, as tools see
them: ``kvlens inspect`` and ``kvlens clear`` offline, and the admin endpoint of a running
engine (``connector/scheduler/admin.py``).

Only headers are read (the first bytes of each record), in batches: one pipelined round trip
per node for a batch of Redis keys. Nothing here touches what is not a KVLens record of this
directory or prefix: Redis keys are found with ``SCAN <prefix>:*`` on every master and removed
one by one with ``UNLINK`` (never ``FLUSHDB``; a prefix cannot contain ':', so another prefix's
keys never match). Disk files are listed and named through the disk tier's own functions
(``tiers/disk.py``), so a change of its directory layout carries over here.

Namespace records (``engine/namespace_records.py``) live beside the chunks: a file
``.kvlens-namespaces/<fingerprint>.json`` in the directory, a key ``<prefix>:ns:<fingerprint>``
in Redis.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..engine.namespace_records import NamespaceRecord, Selector, select
from . import codec
from . import disk as disk_files
from .base import ChunkCorrupt
from .disk import DiskTier
from .redis_tier import RedisTier, RemoteUnavailable

NAMESPACE_DIR = ".kvlens-namespaces"
NAMESPACE_KEY = "ns:"
_CHUNK = re.compile(r"^([0-9a-f]{32})\.r(\d+)$")
_BATCH = 1000


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """One stored record: one rank's share of one chunk."""

    name: str  # <digest>.r<rank>
    stored_bytes: int
    namespace: str  # key fingerprint of the namespace that stored it; "" unknown
    written_s: float | None  # when it was written (the header's time, else the file's)
    damage: str | None = None  # why the record cannot be loaded; None when its header is sound

    @property
    def digest(self) -> str:
        return self.name.split(".", 1)[0]


@dataclass(slots=True)
class Cleared:
    """What a clear removed."""

    records: int = 0  # files or keys (one per chunk and rank)
    chunks: int = 0
    bytes: int = 0
    namespaces: list[str] = field(default_factory=list)  # namespace records removed

    def add(self, other: Cleared) -> None:
        self.records += other.records
        self.chunks += other.chunks
        self.bytes += other.bytes
        self.namespaces += other.namespaces

    def to_json(self) -> dict[str, Any]:
        return {
            "records": self.records,
            "chunks": self.chunks,
            "bytes": self.bytes,
            "namespaces": sorted(set(self.namespaces)),
        }


def check_header(name: str, prefix: bytes, stored_bytes: int) -> tuple[codec.RecordHeader | None, str | None]:
    """The record's header and, if it cannot be loaded, why (from its first bytes and size)."""
    try:
        header = codec.read_header(prefix)
    except ChunkCorrupt as e:
        return None, str(e).removeprefix("record: ")
    if header.name != name:
        return header, "record of another chunk"
    if header.record_bytes != stored_bytes:
        return header, f"{stored_bytes} bytes stored, header says {header.record_bytes}"
    return header, None


def _record(name: str, stored: int, prefix: bytes, mtime_s: float | None) -> ChunkRecord:
    header, damage = check_header(name, prefix, stored)
    if header is None:
        return ChunkRecord(name, stored, "", mtime_s, damage)
    written = header.written_s if header.written_s is not None else mtime_s
    return ChunkRecord(name, stored, header.namespace, written, damage)


def _verify(name: str, record: bytes | bytearray, found: ChunkRecord) -> ChunkRecord:
    """With ``verify``: the whole record read and its payload checksum checked."""
    if found.damage is not None:
        return found
    try:
        layout = codec.read_header(record).layout
        codec.decode(bytearray(record), name, layout)
    except ChunkCorrupt as e:
        return ChunkRecord(found.name, found.stored_bytes, found.namespace, found.written_s, str(e))
    return found


class DiskRecords:
    """The records in one disk tier directory."""

    def __init__(self, root: str) -> None:
        if not os.path.isdir(root):
            raise FileNotFoundError(f"{root}: no such directory")
        self.root = root
        self._tier = DiskTier(root, "", grace_s=0.0, remove_corrupt=False)
        self._ns_dir = os.path.join(root, NAMESPACE_DIR)

    def __repr__(self) -> str:
        return f"disk directory {self.root}"

    def names(self) -> Iterator[tuple[str, str, os.stat_result]]:
        """Every chunk file's storage name (``<digest>.r<rank>``) and path, in either layout."""
        for path in disk_files.chunk_files(self.root):
            try:
                yield os.path.basename(path).removesuffix(disk_files.SUFFIX), path, os.stat(path)
            except FileNotFoundError:  # removed since it was listed
                continue

    def chunks(self, verify: bool = False) -> Iterator[ChunkRecord]:
        for name, path, st in self.names():
            try:
                with open(path, "rb") as f:
                    data = f.read() if verify else f.read(codec.HEADER_PEEK_BYTES)
            except FileNotFoundError:
                continue  # removed since it was listed
            found = _record(name, st.st_size, data, st.st_mtime_ns / 1e9)
            yield _verify(name, data, found) if verify else found

    def remove(self, records: Iterable[ChunkRecord]) -> Cleared:
        cleared = Cleared()
        digests = set()
        for record in records:
            self._tier.delete(record.name)
            cleared.records += 1
            cleared.bytes += record.stored_bytes
            digests.add(record.digest)
        cleared.chunks = len(digests)
        return cleared

    def namespaces(self) -> tuple[list[NamespaceRecord], list[str]]:
        """The namespace records, and the names of files there that are not readable records."""
        found, damaged = [], []
        try:
            entries = sorted(os.listdir(self._ns_dir))  # KVLens's own folder, not the chunk layout
        except FileNotFoundError:
            return [], []
        for entry in entries:
            if not entry.endswith(".json"):
                continue
            try:
                with open(os.path.join(self._ns_dir, entry), "rb") as f:
                    record = NamespaceRecord.from_json(f.read(NAMESPACE_READ_BYTES))
            except (OSError, ValueError):
                damaged.append(entry)
                continue
            if entry == f"{record.fingerprint}.json":
                found.append(record)
            else:
                damaged.append(entry)
        return found, damaged

    def has_namespace(self, fingerprint: str) -> bool:
        return os.path.exists(os.path.join(self._ns_dir, f"{fingerprint}.json"))

    def write_namespace(self, record: NamespaceRecord) -> None:
        os.makedirs(self._ns_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self._ns_dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(record.to_json())
            os.replace(tmp, os.path.join(self._ns_dir, f"{record.fingerprint}.json"))
        except BaseException:
            _unlink(tmp)
            raise

    def remove_namespaces(self, fingerprints: Iterable[str]) -> list[str]:
        removed = []
        for fp in fingerprints:
            if _unlink(os.path.join(self._ns_dir, f"{fp}.json")):
                removed.append(fp)
        return removed


NAMESPACE_READ_BYTES = 64 * 1024


class RedisRecords:
    """The records under one Redis key prefix (a server, or every master of a cluster)."""

    def __init__(self, tier: RedisTier) -> None:
        self._tier = tier
        self.prefix = tier.key_prefix

    def __repr__(self) -> str:
        return f"{self._tier.url.redacted()} prefix {self.prefix!r}"

    @property
    def tier(self) -> RedisTier:
        return self._tier

    def _keys(self, under: str = "") -> Iterator[tuple[Any, list[bytes]]]:
        """Batches of this prefix's keys (those starting ``<prefix>:<under>``), each with the
        client of the master holding them."""
        pattern = f"{self.prefix}:{under}*"
        for client in self._tier.node_clients():
            batch: list[bytes] = []
            try:
                for key in client.scan_iter(match=pattern, count=_BATCH):
                    batch.append(key)
                    if len(batch) >= _BATCH:
                        yield client, batch
                        batch = []
            except Exception as e:  # noqa: BLE001 - redis-py errors must not escape
                raise RemoteUnavailable(f"scanning {self!r} failed: {type(e).__name__}: {e}") from None
            if batch:
                yield client, batch

    def _chunk_name(self, key: bytes) -> str | None:
        name = key.decode(errors="replace")[len(self.prefix) + 1 :]
        return name if _CHUNK.match(name) else None

    def chunks(self, verify: bool = False) -> Iterator[ChunkRecord]:
        for client, keys in self._keys():
            names = [(key, self._chunk_name(key)) for key in keys]
            names = [(key, name) for key, name in names if name is not None]
            pipe = client.pipeline(transaction=False)
            for key, _ in names:
                if verify:
                    pipe.get(key)
                else:
                    pipe.getrange(key, 0, codec.HEADER_PEEK_BYTES - 1)
                pipe.strlen(key)
            replies = _execute(pipe, self)
            for i, (_, name) in enumerate(names):
                data, size = replies[2 * i], replies[2 * i + 1]
                if isinstance(data, Exception) or isinstance(size, Exception):
                    yield ChunkRecord(name, 0, "", None, f"unreadable: {type(data).__name__}")
                    continue
                if not size:
                    continue  # expired or removed since the scan
                found = _record(name, int(size), bytes(data or b""), None)
                yield _verify(name, bytes(data), found) if verify else found

    def remove(self, records: Iterable[ChunkRecord]) -> Cleared:
        cleared = Cleared()
        digests: set[str] = set()
        batch: list[ChunkRecord] = []
        for record in records:
            batch.append(record)
            if len(batch) >= _BATCH:
                self._unlink(batch, cleared, digests)
                batch = []
        self._unlink(batch, cleared, digests)
        cleared.chunks = len(digests)
        return cleared

    def _unlink(self, batch: list[ChunkRecord], cleared: Cleared, digests: set[str]) -> None:
        if not batch:
            return
        replies = self._tier.execute("clear", [("UNLINK", self._tier.key(r.name)) for r in batch])
        for record, reply in zip(batch, replies, strict=True):
            if isinstance(reply, Exception):
                raise reply
            if reply:
                cleared.records += 1
                cleared.bytes += record.stored_bytes
                digests.add(record.digest)

    def remove_all(self) -> Cleared:
        """Every key under the prefix: chunks and namespace records (one UNLINK per key)."""
        cleared = Cleared()
        digests: set[str] = set()
        for client, keys in self._keys():
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.strlen(key)
                pipe.unlink(key)
            replies = _execute(pipe, self)
            for i, key in enumerate(keys):
                size, removed = replies[2 * i], replies[2 * i + 1]
                if isinstance(removed, Exception) or not removed:
                    continue
                name = self._chunk_name(key)
                if name is None:
                    text = key.decode(errors="replace")[len(self.prefix) + 1 :]
                    if text.startswith(NAMESPACE_KEY):
                        cleared.namespaces.append(text[len(NAMESPACE_KEY) :])
                    continue
                cleared.records += 1
                cleared.bytes += size if isinstance(size, int) else 0
                digests.add(name.split(".", 1)[0])
        cleared.chunks = len(digests)
        return cleared

    def namespaces(self) -> tuple[list[NamespaceRecord], list[str]]:
        keys = [k for _, batch in self._keys(NAMESPACE_KEY) for k in batch]
        replies = self._tier.execute("namespaces", [("GET", k) for k in keys]) if keys else []
        found, damaged = [], []
        for key, reply in zip(keys, replies, strict=True):
            fp = key.decode(errors="replace")[len(self.prefix) + 1 + len(NAMESPACE_KEY) :]
            if isinstance(reply, Exception) or reply is None:
                continue
            try:
                record = NamespaceRecord.from_json(bytes(reply))
            except ValueError:
                damaged.append(fp)
                continue
            if record.fingerprint == fp:
                found.append(record)
            else:
                damaged.append(fp)
        return found, damaged

    def has_namespace(self, fingerprint: str) -> bool:
        (reply,) = self._tier.execute("namespaces", [("EXISTS", self._ns_key(fingerprint))])
        if isinstance(reply, Exception):
            raise reply
        return bool(reply)

    def write_namespace(self, record: NamespaceRecord, ttl_s: int | None = None) -> None:
        command: tuple[Any, ...] = ("SET", self._ns_key(record.fingerprint), record.to_json())
        if ttl_s:
            command += ("EX", ttl_s)
        (reply,) = self._tier.execute("namespaces", [command])
        if isinstance(reply, Exception):
            raise reply

    def remove_namespaces(self, fingerprints: Iterable[str]) -> list[str]:
        fps = list(fingerprints)
        if not fps:
            return []
        replies = self._tier.execute("clear", [("UNLINK", self._ns_key(fp)) for fp in fps])
        return [
            fp for fp, reply in zip(fps, replies, strict=True) if reply and not isinstance(reply, Exception)
        ]

    def close(self) -> None:
        self._tier.close()

    def _ns_key(self, fingerprint: str) -> str:
        return self._tier.key(NAMESPACE_KEY + fingerprint)


Store = DiskRecords | RedisRecords


def clear(
    store: Store, selector: Selector, selected: set[str] | None = None, before_s: float | None = None
) -> Cleared:
    """Remove the chunks (and namespace records) the selector takes from one store.

    ``selected``: fingerprints of namespaces already picked from records found elsewhere (a
    running engine knows namespaces no record in this store describes yet). ``before_s``: only
    chunks written at or before this time (a running engine's clear leaves later stores alone)."""
    if selector.everything and before_s is None and isinstance(store, RedisRecords):
        return store.remove_all()
    records, _ = store.namespaces()
    chosen = select(records, selector) | (selected or set())
    taken: set[str] = set()

    def takes(chunk: ChunkRecord) -> bool:
        if before_s is not None and chunk.written_s is not None and chunk.written_s > before_s:
            return False
        if selector.takes(chunk.namespace, chosen):
            taken.add(chunk.namespace)
            return True
        return False

    cleared = store.remove(c for c in store.chunks() if takes(c))
    gone = {r.fingerprint for r in records} if selector.everything else chosen | (taken - {""})
    cleared.namespaces = store.remove_namespaces(sorted(gone))
    return cleared


def _execute(pipe: Any, where: object) -> list[Any]:
    try:
        return pipe.execute(raise_on_error=False)
    except Exception as e:  # noqa: BLE001 - redis-py errors must not escape
        raise RemoteUnavailable(f"reading {where!r} failed: {type(e).__name__}: {e}") from None


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
