"""Self-checking chunk records for tiers that leave the process (disk, remote).

Record = magic, header length, JSON header (name, layout, payload size, xxh3 checksum),
payload. A truncated, bit-flipped or misnamed record is rejected, never loaded.
"""

from __future__ import annotations

import json
import struct

import xxhash

from .base import ChunkCorrupt

MAGIC = b"KVLENS1\n"
_LEN = struct.Struct("<I")


def checksum(payload: memoryview | bytes) -> str:
    return xxhash.xxh3_128_hexdigest(payload)


def encode_header(name: str, layout: str, payload: memoryview) -> bytes:
    header = json.dumps(
        {"name": name, "layout": layout, "nbytes": payload.nbytes, "xxh3": checksum(payload)},
        separators=(",", ":"),
    ).encode()
    return MAGIC + _LEN.pack(len(header)) + header


def decode(record: bytearray | memoryview, name: str, layout: str) -> memoryview:
    """The payload inside ``record`` after checking it is the chunk asked for, intact."""
    view = memoryview(record)
    fixed = len(MAGIC) + _LEN.size
    if view.nbytes < fixed or bytes(view[: len(MAGIC)]) != MAGIC:
        raise ChunkCorrupt(f"{name}: not a KVLens chunk record")
    (hlen,) = _LEN.unpack(view[len(MAGIC) : fixed])
    if view.nbytes < fixed + hlen:
        raise ChunkCorrupt(f"{name}: truncated header")
    try:
        header = json.loads(bytes(view[fixed : fixed + hlen]))
    except (ValueError, RecursionError) as e:  # RecursionError: a header of nested brackets
        raise ChunkCorrupt(f"{name}: unreadable header") from e
    if not isinstance(header, dict):
        raise ChunkCorrupt(f"{name}: header is not a JSON object")
    if header.get("name") != name or header.get("layout") != layout:
        raise ChunkCorrupt(f"{name}: record is for another chunk or KV layout")
    payload = view[fixed + hlen :]
    if payload.nbytes != header.get("nbytes"):
        raise ChunkCorrupt(f"{name}: payload is {payload.nbytes} bytes, expected {header.get('nbytes')}")
    if checksum(payload) != header.get("xxh3"):
        raise ChunkCorrupt(f"{name}: checksum mismatch")
    return payload
