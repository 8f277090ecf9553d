"""First-chunk marks: which namespaces stored a prompt, told through a shared store so that
another instance can explain its miss (``other_namespace``) for a prompt it never saw stored.

``namespaces.py`` remembers, in one engine's memory, the namespaces its own requests stored a
first chunk under. Engines that share a disk directory or a Redis prefix also leave marks
there: a mark pairs the first 8 bytes of a prompt's namespace-free first-chunk fingerprint
(``keys.first_chunk_fingerprint``) with the key fingerprint of the namespace that stored it.
The namespace's parts are read from its namespace record (``namespace_records.py``), which
holds no cache salt and no tag value, so an explanation names what differs and never a value.
Whether a record's namespace is the request's own tenant (same salt, same tags) is found by
keying the request's salt and tags with the record's other parts: a lookup prefers its own
tenant's namespace, and a client is told only of those (``namespaces.client_miss_reason``).

Marks live in ``BUCKETS`` blobs chosen by the mark's first byte, each holding at most
``PER_BUCKET`` entries (most recent last): at most 256 x 256 x 14 bytes (under 1 MiB) per
store, however many prompts are stored. Writers merge their new entries into a bucket (read,
merge, write: two engines writing the same bucket at once may lose an entry, which costs an
explanation, never a hit). Readers keep the whole set in memory (``MarkView``), refreshed off
the step loop, so a lookup never waits on the store. Pure logic.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import fields

from .keys import Namespace, key_fingerprint
from .namespace_records import FINGERPRINT, NamespaceRecord

MAGIC = b"KVLM1"
MARK_BYTES = 8
FP_BYTES = 6  # a key fingerprint: 12 hex digits
ENTRY_BYTES = MARK_BYTES + FP_BYTES
BUCKETS = 256
PER_BUCKET = 256
MAX_BUCKET_BYTES = len(MAGIC) + PER_BUCKET * ENTRY_BYTES

Entry = tuple[bytes, str]  # (mark, namespace key fingerprint)


def mark_of(fingerprint: bytes) -> bytes:
    return fingerprint[:MARK_BYTES]


def bucket_of(mark: bytes) -> int:
    return mark[0]


def encode(entries: Iterable[Entry]) -> bytes:
    return MAGIC + b"".join(mark + bytes.fromhex(fp) for mark, fp in entries)


def decode(raw: bytes | bytearray | None) -> list[Entry]:
    """A bucket's entries; a missing, damaged or foreign blob reads as empty (never raises)."""
    if not raw or len(raw) > MAX_BUCKET_BYTES or not bytes(raw[: len(MAGIC)]) == MAGIC:
        return []
    body = bytes(raw[len(MAGIC) :])
    if len(body) % ENTRY_BYTES:
        return []
    return [
        (body[i : i + MARK_BYTES], body[i + MARK_BYTES : i + ENTRY_BYTES].hex())
        for i in range(0, len(body), ENTRY_BYTES)
    ]


def merge(existing: Iterable[Entry], new: Iterable[Entry], limit: int = PER_BUCKET) -> list[Entry]:
    """``existing`` then ``new`` (an entry seen again moves to the end), the oldest dropped."""
    out: dict[Entry, None] = {}
    for entry in (*existing, *new):
        out.pop(entry, None)
        out[entry] = None
    return list(out)[-limit:]


def record_differences(mine: Namespace, other: NamespaceRecord) -> list[str]:
    """The names of the namespace parts that differ, as far as ``other``'s record tells. The
    record holds no salt or tag value, but every other part of the key: so ``mine``'s salt and
    tags, keyed with the record's parts, give the record's fingerprint exactly when the two
    namespaces belong to the same tenant."""
    plain = [f.name for f in fields(Namespace) if f.name not in ("cache_salt", "tags")]
    out = [name for name in plain if getattr(mine, name) != getattr(other, name)]
    return out + tenant_differences(mine, other)


def tenant_differences(
    mine: Namespace, other: NamespaceRecord, keyed: dict[tuple[object, ...], str] | None = None
) -> list[str]:
    """``cache_salt`` and/or ``tags`` where ``other`` belongs to another tenant than ``mine``;
    empty when it is the same tenant (same salt, same tags, or neither). ``keyed`` memoizes
    ``mine``'s salt and tags keyed with a record's other parts (one hash for many records)."""
    salted = mine.cache_salt is not None
    tag_names = sorted(name for name, _ in mine.tags)
    out = []
    if salted != other.salted:
        out.append("cache_salt")
    if tag_names != sorted(other.tag_names):
        out.append("tags")
    if out or not (salted or tag_names):
        return out
    parts = (other.model, other.dtype, other.kv_layout, other.world_size, other.lora)
    fingerprint = keyed.get(parts) if keyed is not None else None
    if fingerprint is None:
        fingerprint = key_fingerprint(other.keyed_with(mine.cache_salt, dict(mine.tags)))
        if keyed is not None:
            keyed[parts] = fingerprint
    if fingerprint == other.fingerprint:
        return []
    return (["cache_salt"] if salted else []) + (["tags"] if tag_names else [])  # values differ


_MAX_REMEMBERED_NAMESPACES = 1024  # namespaces whose verdicts a view keeps between replaces


class MarkView:
    """The marks of the shared stores, as last read: mark -> namespace fingerprints (most recent
    last), with the records that describe them. Bounded by what the stores can hold."""

    def __init__(self) -> None:
        self._by_mark: dict[bytes, tuple[str, ...]] = {}
        self._records: dict[str, NamespaceRecord] = {}
        # namespace fingerprint -> {record fingerprint: same tenant?}, until the next replace:
        # a lookup's miss then costs a dictionary probe per namespace on its mark, not a hash
        self._same_tenant: dict[str, dict[str, bool]] = {}

    def __len__(self) -> int:
        return len(self._by_mark)

    def replace(self, entries: Iterable[Entry], records: Mapping[str, NamespaceRecord]) -> None:
        by_mark: dict[bytes, list[str]] = {}
        for mark, fp in entries:
            if fp in records:
                spaces = by_mark.setdefault(mark, [])
                if fp in spaces:
                    spaces.remove(fp)
                spaces.append(fp)
        self._by_mark = {m: tuple(fps) for m, fps in by_mark.items()}
        self._records = dict(records)
        self._same_tenant = {}

    def others_than(self, fingerprint: str) -> bool:
        """Whether any namespace but this one left marks (else a lookup need not ask)."""
        return len(self._records) > (fingerprint in self._records)

    def other(self, first_chunk: bytes, namespace: Namespace) -> NamespaceRecord | None:
        """The record of the most recent other namespace of the same tenant that stored this
        first chunk, else of the most recent namespace of another tenant (``namespaces.py``:
        what a client is told must not depend on other tenants' prompts)."""
        mine = key_fingerprint(namespace)
        found = None
        keyed: dict[tuple[object, ...], str] = {}
        verdicts = self._same_tenant.get(mine)
        if verdicts is None:
            if len(self._same_tenant) >= _MAX_REMEMBERED_NAMESPACES:
                self._same_tenant.clear()
            verdicts = self._same_tenant[mine] = {}
        for fp in reversed(self._by_mark.get(mark_of(first_chunk), ())):
            if fp != mine:
                record = self._records[fp]
                same = verdicts.get(fp)
                if same is None:
                    same = verdicts[fp] = not tenant_differences(namespace, record, keyed)
                if same:
                    return record
                found = found or record
        return found


def valid_fingerprint(fp: str) -> bool:
    return bool(FINGERPRINT.match(fp))
