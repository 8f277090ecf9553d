"""Self-checking chunk records for tiers that leave the process (disk, remote).

Record = magic, header length, JSON header, payload. The header holds the chunk's name, the KV
layout, the payload size and its xxh3 checksum; a truncated, bit-flipped or misnamed record is
rejected, never loaded. Two optional header fields describe the record for tools (``kvlens
inspect`` and ``kvlens clear``): ``ns``, the key fingerprint of the namespace that stored
the chunk (a chunk's name, a chained hash, does not reveal it; "" when unknown), and ``t``, when
it was written (whole Unix seconds); ``hx`` checks both, so a flipped bit there is caught like
one anywhere else. The payload checksum is unchanged: records written before these fields
existed load as before, and readers that predate them load new records (they ignore them).

``lx`` (disk records): one xxh3 checksum per layer of a layer-major payload, so that a reader
can check and use layer 0 before the last layer's bytes are read (``disk_layers.py``); the
whole payload's checksum stays beside it for readers that predate it.

With a store key (``record_trust.py``) the checksums are BLAKE3 digests (``b3``, ``lb3``) and
``mac`` tags the header; a reader with the key refuses a record without a valid tag. Every
length a record announces (its header's, its payload's) is checked against what a record of
the tier's layout can be before anything is allocated for it.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass

import xxhash

from .base import ChunkCorrupt
from .record_trust import MAX_HEADER_BYTES, OPEN, XXH3, Digests, RecordTrust, WholeState, digests_of

MAGIC = b"KVLENS1\n"
_LEN = struct.Struct("<I")
PREFIX_BYTES = len(MAGIC) + _LEN.size  # what precedes the JSON header
HEADER_PEEK_BYTES = MAX_HEADER_BYTES  # enough to read a whole header of any record KVLens writes
_SUM_PIECE = 64 * 1024  # RecordCheck adds arrived payload to its checksum in pieces of at least this


def checksum(payload: memoryview | bytes) -> str:
    return xxhash.xxh3_128_hexdigest(payload)


def layer_checksum(layer: memoryview | bytes) -> str:
    return xxhash.xxh3_64_hexdigest(layer)


def layer_checksum_of(parts: Iterable[memoryview]) -> str:
    """``layer_checksum`` of the parts' bytes one after the other."""
    state = xxhash.xxh3_64()
    for part in parts:
        state.update(part)
    return state.hexdigest()


def encode_header(
    name: str,
    layout: str,
    payload: memoryview,
    namespace: str = "",
    layers: int = 0,
    trust: RecordTrust = OPEN,
) -> bytes:
    """The header of ``payload``'s record; ``layers`` > 1: with a checksum per layer (``lx``);
    ``trust`` with a key: BLAKE3 digests and a keyed tag."""
    written = int(time.time())
    digests = trust.digests
    fields: dict[str, object] = {
        "name": name,
        "layout": layout,
        "nbytes": payload.nbytes,
        digests.whole_field: digests.whole(payload),
        "ns": namespace,
        "t": written,
        "hx": _about_checksum(namespace, written),
    }
    if layers > 1 and payload.nbytes % layers == 0:
        flat = payload.cast("B") if payload.format != "B" or payload.ndim != 1 else payload
        size = payload.nbytes // layers
        fields[digests.layers_field] = [digests.layer(flat[i * size : (i + 1) * size]) for i in range(layers)]
    if trust.key is not None:
        fields["mac"] = trust.tag(fields)
    header = json.dumps(fields, separators=(",", ":")).encode()
    return MAGIC + _LEN.pack(len(header)) + header


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """A record's header as read by tools, without its payload."""

    name: str
    layout: str
    nbytes: int  # payload bytes the header announces
    header_bytes: int  # bytes before the payload (magic, length and JSON)
    namespace: str  # "" when the record predates namespace fingerprints
    written_s: int | None  # None when the record predates write times

    @property
    def record_bytes(self) -> int:
        return self.header_bytes + self.nbytes


def header_length(prefix: bytes | memoryview) -> int:
    """Bytes of the whole header (magic, length, JSON) of a record starting with ``prefix``."""
    view = memoryview(prefix)
    if view.nbytes < PREFIX_BYTES or bytes(view[: len(MAGIC)]) != MAGIC:
        raise ChunkCorrupt("not a KVLens chunk record")
    return PREFIX_BYTES + _LEN.unpack(view[len(MAGIC) : PREFIX_BYTES])[0]


def read_header(prefix: bytes | memoryview) -> RecordHeader:
    """The header of a record whose first bytes are ``prefix`` (at least the whole header)."""
    view = memoryview(prefix)
    end = header_length(view)
    if view.nbytes < end:
        raise ChunkCorrupt("truncated header")
    header = _parse(view[PREFIX_BYTES:end], "record")
    name, layout, nbytes = header.get("name"), header.get("layout"), header.get("nbytes")
    if not isinstance(name, str) or not isinstance(layout, str) or not _count(nbytes):
        raise ChunkCorrupt("header lacks name, layout or size")
    ns, written = _about(header, name)
    return RecordHeader(name, layout, nbytes, end, ns, written)


@dataclass(frozen=True, slots=True)
class CheckedHeader:
    """A record's header, checked to be the chunk asked for, for a reader to check its payload."""

    end: int  # bytes before the payload
    nbytes: int  # payload bytes
    whole: str  # the payload's checksum
    layers: tuple[str, ...] | None  # per-layer checksums (``lx``), or None
    digests: Digests = XXH3  # how ``whole`` and ``layers`` were computed


def check_header(
    prefix: bytes | memoryview, name: str, layout: str, trust: RecordTrust = OPEN
) -> CheckedHeader:
    """The header of record ``name`` whose first bytes are ``prefix`` (the whole header),
    within ``trust``'s size bound and, with a key, tagged with it."""
    view = memoryview(prefix)
    if view.nbytes < PREFIX_BYTES or bytes(view[: len(MAGIC)]) != MAGIC:
        raise ChunkCorrupt(f"{name}: not a KVLens chunk record")
    (hlen,) = _LEN.unpack(view[len(MAGIC) : PREFIX_BYTES])
    if PREFIX_BYTES + hlen > MAX_HEADER_BYTES:
        raise ChunkCorrupt(f"{name}: a header of {hlen} bytes, longer than any record's")
    if view.nbytes < PREFIX_BYTES + hlen:
        raise ChunkCorrupt(f"{name}: truncated header")
    header = _parse(view[PREFIX_BYTES : PREFIX_BYTES + hlen], name)
    _about(header, name)
    if header.get("name") != name or header.get("layout") != layout:
        raise ChunkCorrupt(f"{name}: record is for another chunk or KV layout")
    if trust.key is not None and not trust.is_tagged(header):
        raise ChunkCorrupt(f"{name}: record not tagged with this store's key (store_auth_key)")
    digests = digests_of(header)
    nbytes, whole, layers = (
        header.get("nbytes"),
        header.get(digests.whole_field),
        header.get(digests.layers_field),
    )
    if not _count(nbytes) or not isinstance(whole, str):
        raise ChunkCorrupt(f"{name}: header lacks the payload's size or checksum")
    if trust.too_large(nbytes):
        raise ChunkCorrupt(f"{name}: a payload of {nbytes} bytes, larger than any chunk of this layout")
    if layers is not None and (
        not isinstance(layers, list)
        or len(layers) < 2
        or nbytes % len(layers)
        or not all(isinstance(x, str) for x in layers)
    ):
        raise ChunkCorrupt(f"{name}: damaged layer checksums")
    return CheckedHeader(PREFIX_BYTES + hlen, nbytes, whole, tuple(layers) if layers else None, digests)


def decode(record: bytearray | memoryview, name: str, layout: str, trust: RecordTrust = OPEN) -> memoryview:
    """The payload inside ``record`` after checking it is the chunk asked for, intact (and,
    with ``trust``'s key, written by a holder of that key)."""
    view = memoryview(record)
    header = check_header(view, name, layout, trust)
    payload = view[header.end :]
    if payload.nbytes != header.nbytes:
        raise ChunkCorrupt(f"{name}: payload is {payload.nbytes} bytes, expected {header.nbytes}")
    if header.digests.whole(payload) != header.whole:
        raise ChunkCorrupt(f"{name}: checksum mismatch")
    return payload


class RecordCheck:
    """``decode`` of one record whose bytes arrive in pieces (a socket's reads): the header is
    checked as soon as it is in and each piece of payload is added to its checksum right after
    it landed, while it is still in the CPU's cache. ``payload`` then answers exactly as
    ``decode`` of the whole record would (the same errors, in the same order)."""

    __slots__ = ("name", "layout", "trust", "_header", "_state", "_summed", "_failed")

    def __init__(self, name: str, layout: str, trust: RecordTrust = OPEN) -> None:
        self.name, self.layout, self.trust = name, layout, trust
        self._header: CheckedHeader | None = None
        self._state: WholeState | None = None
        self._summed = 0  # bytes of the record up to which the payload is in the checksum
        self._failed = False  # the header was refused: ``payload`` finds why on the whole record

    def fed(self, record: memoryview, have: int) -> None:
        """``record[:have]`` is in (``record``: the buffer the whole record is read into)."""
        if self._failed:
            return
        if self._header is None:
            if have < PREFIX_BYTES:
                return
            end = PREFIX_BYTES + _LEN.unpack(record[len(MAGIC) : PREFIX_BYTES])[0]
            if have < min(end, MAX_HEADER_BYTES):  # longer ones are refused by check_header
                return
            try:
                self._header = check_header(record[:have], self.name, self.layout, self.trust)
            except ChunkCorrupt:
                self._failed = True
                return
            self._state = self._header.digests.whole_state()
            self._summed = self._header.end
        if have - self._summed >= _SUM_PIECE:
            assert self._state is not None
            self._state.update(record[self._summed : have])
            self._summed = have

    def payload(self, record: memoryview) -> memoryview:
        """The payload of the whole ``record`` (the bytes ``fed`` saw), checked as ``decode``."""
        header, state = self._header, self._state
        if header is None or state is None:
            return decode(record, self.name, self.layout, self.trust)
        payload = record[header.end :]
        if payload.nbytes != header.nbytes:
            raise ChunkCorrupt(f"{self.name}: payload is {payload.nbytes} bytes, expected {header.nbytes}")
        state.update(record[self._summed :])
        if state.hexdigest() != header.whole:
            raise ChunkCorrupt(f"{self.name}: checksum mismatch")
        return payload


def _parse(raw: memoryview, what: str) -> dict:
    try:
        header = json.loads(bytes(raw))
    except (ValueError, RecursionError) as e:  # RecursionError: a header of nested brackets
        raise ChunkCorrupt(f"{what}: unreadable header") from e
    if not isinstance(header, dict):
        raise ChunkCorrupt(f"{what}: header is not a JSON object")
    return header


_ABOUT = ("ns", "t", "hx")


def _about_checksum(namespace: str, written: int) -> str:
    return xxhash.xxh3_64_hexdigest(f"{namespace}|{written}".encode())


def _about(header: dict, what: str) -> tuple[str, int | None]:
    """The descriptive fields (namespace, write time), checked; ("", None) in an older record."""
    present = [key in header for key in _ABOUT]
    if not any(present):
        return "", None
    ns, written = header.get("ns"), header.get("t")
    if (
        not all(present)
        or not isinstance(ns, str)
        or not _count(written)
        or header["hx"] != _about_checksum(ns, written)
    ):
        raise ChunkCorrupt(f"{what}: damaged namespace or write time")
    return ns, written


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
