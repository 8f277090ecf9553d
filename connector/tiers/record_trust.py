"""What a reader of a shared store trusts in a record: who wrote it, and how large it can be.

A record's own checksums (xxh3) catch damage, not a writer who means it: xxh3 has no key, so
anyone who can write the store's directory or key prefix can write a record that checks for a
name they can compute, and xxh3 is no cryptographic hash, so even a record's payload can be
changed under its checksum. With ``store_auth_key`` set, records are written with BLAKE3
digests of the payload (and of each layer, ``lb3``, for layer-wise reads) instead of xxh3, and
their header carries ``mac``: a BLAKE3 tag keyed by the store's key over the chunk's name
(digest and rank), the KV layout, the payload's size, those digests, the namespace and the
write time. A reader with the key refuses a record without a valid tag: written by an engine
without the key or with another key, or moved under another chunk's name. Each layer is then
checked against its authenticated digest before it is used, so the tag is checked once, at the
header, and costs nothing per byte beyond the digests themselves (BLAKE3 in place of xxh3:
bench/record_auth.py measures both).

A reader without a key accepts both kinds of record (it checks BLAKE3 digests as it checks
xxh3 ones). Size bounds: a tier knows the largest payload a chunk of its layout can have
(``max_payload_bytes``); any length a store announces (a reply's length, a file's size, a
header's ``nbytes``) above it is refused before anything is allocated or read.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import blake3
import xxhash

MAX_HEADER_BYTES = 16384  # no record KVLens writes has a longer header (lb3: ~35 B a layer)
DIGEST_BYTES = 16  # of each BLAKE3 payload and layer digest
_TAG_BYTES = 32
_KEY_CONTEXT = "KVLens store_auth_key record tags, version 1"


class Digests:
    """The payload checksums of records without a key: xxh3 (fields ``xxh3`` and ``lx``)."""

    whole_field = "xxh3"
    layers_field = "lx"

    def whole(self, data: memoryview | bytes) -> str:
        return xxhash.xxh3_128_hexdigest(data)

    def layer(self, data: memoryview | bytes) -> str:
        return xxhash.xxh3_64_hexdigest(data)

    def whole_state(self) -> WholeState:
        """``whole`` of bytes fed one piece after another (``update``, then ``hexdigest``)."""
        return xxhash.xxh3_128()

    def layer_of(self, parts: Iterable[memoryview]) -> str:
        """``layer`` of the parts' bytes one after the other."""
        state = xxhash.xxh3_64()
        for part in parts:
            state.update(part)
        return state.hexdigest()


class Blake3Digests(Digests):
    """The payload digests of records written with a key: BLAKE3 (``b3`` and ``lb3``)."""

    whole_field = "b3"
    layers_field = "lb3"

    def whole(self, data: memoryview | bytes) -> str:
        return blake3.blake3(data).hexdigest(DIGEST_BYTES)

    def layer(self, data: memoryview | bytes) -> str:
        return blake3.blake3(data).hexdigest(DIGEST_BYTES)

    def whole_state(self) -> WholeState:
        return _Blake3State()

    def layer_of(self, parts: Iterable[memoryview]) -> str:
        state = blake3.blake3()
        for part in parts:
            state.update(part)
        return state.hexdigest(DIGEST_BYTES)


class WholeState(Protocol):
    def update(self, data: memoryview | bytes, /) -> object: ...
    def hexdigest(self) -> str: ...


class _Blake3State:
    __slots__ = ("_state",)

    def __init__(self) -> None:
        self._state = blake3.blake3()

    def update(self, data: memoryview | bytes) -> None:
        self._state.update(data)

    def hexdigest(self) -> str:
        return self._state.hexdigest(DIGEST_BYTES)


XXH3 = Digests()
BLAKE3 = Blake3Digests()


def digests_of(header: dict) -> Digests:
    """The digests a record's header holds: BLAKE3 when it has a ``b3`` field, else xxh3."""
    return BLAKE3 if BLAKE3.whole_field in header else XXH3


@dataclass(frozen=True, slots=True)
class RecordTrust:
    """A tier's rules for the records it writes and reads."""

    key: bytes | None = field(default=None, repr=False)  # the tag key; None: records are not tagged
    max_payload_bytes: int | None = None  # the largest payload of a chunk of this layout; None: any

    @classmethod
    def of(cls, secret: str | bytes | None, max_payload_bytes: int | None = None) -> RecordTrust:
        """The rules for ``store_auth_key`` ``secret`` (None: untagged records)."""
        if secret is None:
            return cls(None, max_payload_bytes)
        raw = secret.encode() if isinstance(secret, str) else secret
        return cls(blake3.blake3(raw, derive_key_context=_KEY_CONTEXT).digest(), max_payload_bytes)

    @property
    def digests(self) -> Digests:
        """What records written under these rules carry."""
        return BLAKE3 if self.key is not None else XXH3

    @property
    def max_record_bytes(self) -> int | None:
        """The largest record (header and payload) a reader can get; None: no bound."""
        return None if self.max_payload_bytes is None else MAX_HEADER_BYTES + self.max_payload_bytes

    def tag(self, header: dict) -> str:
        """The keyed tag of a header's fields that a reader relies on."""
        assert self.key is not None
        digests = digests_of(header)
        signed = [
            header.get("name"),
            header.get("layout"),
            header.get("nbytes"),
            header.get(digests.whole_field),
            header.get(digests.layers_field),
            header.get("ns"),
            header.get("t"),
        ]
        text = json.dumps(signed, separators=(",", ":"), ensure_ascii=True).encode()
        return blake3.blake3(text, key=self.key).hexdigest(_TAG_BYTES)

    def is_tagged(self, header: dict) -> bool:
        """Whether ``header`` carries a valid tag of this key (over BLAKE3 digests)."""
        mac = header.get("mac")
        if self.key is None or not isinstance(mac, str) or digests_of(header) is not BLAKE3:
            return False
        return hmac.compare_digest(mac, self.tag(header))

    def too_large(self, nbytes: int, whole_record: bool = False) -> bool:
        """Whether a store announcing ``nbytes`` (of payload, or of a whole record) lies."""
        bound = self.max_record_bytes if whole_record else self.max_payload_bytes
        return bound is not None and nbytes > bound


OPEN = RecordTrust()  # no key, no size bound: tools that read any layout's records
