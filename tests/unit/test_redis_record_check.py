"""codec.RecordCheck (the remote tier checks a record while its bytes arrive) answers exactly
as codec.decode of the whole record: the same payload, the same refusals."""

from __future__ import annotations

import random

import pytest

from connector.tiers import codec
from connector.tiers.base import ChunkCorrupt
from connector.tiers.record_trust import MAX_HEADER_BYTES, RecordTrust

LAYOUT = "layout-a"
KEYED = RecordTrust.of("secret", max_payload_bytes=1 << 20)


def _record(nbytes: int, seed: int = 0, trust: RecordTrust = codec.OPEN, name: str = "c.r0") -> bytearray:
    payload = memoryview(bytearray(random.Random(seed).randbytes(nbytes)))
    return bytearray(codec.encode_header(name, LAYOUT, payload, "ns", trust=trust)) + payload


def _arriving(record: bytearray, seed: int, trust: RecordTrust = codec.OPEN, name: str = "c.r0"):
    """RecordCheck fed ``record`` in random pieces, as a socket's reads land; its answer."""
    view = memoryview(record)
    check = codec.RecordCheck(name, LAYOUT, trust)
    pieces = random.Random(seed)
    have = 0
    while have < len(record):
        check.fed(view, have)
        have = min(len(record), have + pieces.choice([1, 7, 300, 5000, 70_000, 300_000]))
    try:
        return check.payload(view.toreadonly())
    except ChunkCorrupt as e:
        return ("refused", str(e))


def _decoded(record: bytearray, trust: RecordTrust = codec.OPEN, name: str = "c.r0"):
    try:
        return codec.decode(memoryview(record).toreadonly(), name, LAYOUT, trust)
    except ChunkCorrupt as e:
        return ("refused", str(e))


def _damaged(record: bytearray, how: str) -> bytearray:
    out = bytearray(record)
    end = codec.header_length(record)
    if how == "payload bit":
        out[end + (len(out) - end) // 2] ^= 0x10
    elif how == "last payload byte":
        out[-1] ^= 0x01
    elif how == "header bit":
        out[end - 5] ^= 0x01
    elif how == "magic":
        out[0] ^= 0xFF
    elif how == "truncated payload":
        del out[-100:]
    elif how == "truncated header":
        del out[end - 10 :]
    elif how == "stub":
        del out[5:]
    elif how == "header too long":
        out[8:12] = (MAX_HEADER_BYTES + 1).to_bytes(4, "little")
    elif how == "longer payload":
        out += b"x"
    return out


@pytest.mark.parametrize("nbytes", [0, 1, 65_535, 1 << 20])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_an_intact_record_gives_its_payload_in_any_pieces(nbytes, seed):
    record = _record(nbytes, seed)
    got = _arriving(record, seed)
    assert isinstance(got, memoryview) and got == _decoded(record)
    assert got.readonly


@pytest.mark.parametrize(
    "how",
    [
        "payload bit",
        "last payload byte",
        "header bit",
        "magic",
        "truncated payload",
        "truncated header",
        "stub",
        "header too long",
        "longer payload",
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_a_damaged_record_is_refused_as_decode_refuses_it(how, seed):
    record = _damaged(_record(200_000, seed), how)
    expected = _decoded(record)
    assert expected[0] == "refused"
    assert _arriving(record, seed) == expected


def test_another_chunks_record_is_refused():
    record = _record(100_000, name="other.r0")
    assert (
        _arriving(record, 0)
        == _decoded(record)
        == ("refused", "c.r0: record is for another chunk or KV layout")
    )


def test_with_a_store_key_an_untagged_record_is_refused_and_a_tagged_one_loads():
    untagged = _record(100_000)
    assert _arriving(untagged, 0, KEYED) == _decoded(untagged, KEYED)
    assert "store_auth_key" in _arriving(untagged, 0, KEYED)[1]
    tagged = _record(100_000, trust=KEYED)
    assert _arriving(tagged, 1, KEYED) == _decoded(tagged, KEYED) == tagged[codec.header_length(tagged) :]
    flipped = _damaged(tagged, "payload bit")
    assert _arriving(flipped, 2, KEYED) == _decoded(flipped, KEYED) == ("refused", "c.r0: checksum mismatch")
