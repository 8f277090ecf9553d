"""Chunk records name the namespace that stored them and when, for tools; loads ignore both."""

import json
import os
import time

import pytest

from connector.tiers import codec
from connector.tiers.base import ChunkCorrupt
from connector.tiers.disk import DiskTier

NAME = "ab" * 16 + ".r0"


def _old_record(name: str, layout: str, payload: bytes) -> bytes:
    """A record as KVLens wrote it before namespaces and write times were recorded."""
    header = json.dumps(
        {"name": name, "layout": layout, "nbytes": len(payload), "xxh3": codec.checksum(payload)},
        separators=(",", ":"),
    ).encode()
    return codec.MAGIC + len(header).to_bytes(4, "little") + header + payload


def test_a_record_written_before_namespaces_still_loads_and_reads_as_unknown():
    payload = os.urandom(500)
    record = _old_record(NAME, "L", payload)
    assert bytes(codec.decode(bytearray(record), NAME, "L")) == payload
    header = codec.read_header(record[: codec.HEADER_PEEK_BYTES])
    assert (header.namespace, header.written_s, header.nbytes) == ("", None, 500)
    assert header.record_bytes == len(record)


def test_a_new_record_names_its_namespace_and_write_time():
    payload = memoryview(os.urandom(300))
    before = int(time.time())
    record = codec.encode_header(NAME, "L", payload, "0123456789ab") + bytes(payload)
    header = codec.read_header(record)
    assert header.name == NAME and header.layout == "L" and header.namespace == "0123456789ab"
    assert before <= header.written_s <= time.time() and header.record_bytes == len(record)
    assert bytes(codec.decode(bytearray(record), NAME, "L")) == bytes(payload)


def test_a_new_record_loads_in_a_reader_that_predates_the_fields():
    """What an older KVLens checks: name, layout, size, payload checksum; other fields ignored."""
    payload = memoryview(os.urandom(300))
    record = codec.encode_header(NAME, "L", payload, "0123456789ab") + bytes(payload)
    hlen = int.from_bytes(record[8:12], "little")
    header = json.loads(record[12 : 12 + hlen])
    body = record[12 + hlen :]
    assert header["name"] == NAME and header["layout"] == "L" and header["nbytes"] == len(body)
    assert header["xxh3"] == codec.checksum(body)


@pytest.mark.parametrize(
    "change", [{"ns": "ffffffffffff"}, {"t": 1}, {"hx": "0" * 16}, {"hx": None}, {"t": None}]
)
def test_a_changed_or_partial_namespace_field_is_a_damaged_record(change):
    payload = os.urandom(64)
    record = codec.encode_header(NAME, "L", memoryview(payload), "0123456789ab")
    header = json.loads(record[12:])
    for key, value in change.items():
        if value is None:
            del header[key]
        else:
            header[key] = value
    raw = json.dumps(header).encode()
    damaged = codec.MAGIC + len(raw).to_bytes(4, "little") + raw + payload
    with pytest.raises(ChunkCorrupt):
        codec.read_header(damaged)
    with pytest.raises(ChunkCorrupt):
        codec.decode(bytearray(damaged), NAME, "L")


def test_disk_records_carry_the_namespace_they_were_stored_under(tmp_path):
    tier = DiskTier(str(tmp_path), "L")
    tier.put(NAME, memoryview(os.urandom(100)), "0123456789ab")
    with open(tier.path(NAME), "rb") as f:
        assert codec.read_header(f.read(codec.HEADER_PEEK_BYTES)).namespace == "0123456789ab"


def test_each_store_names_its_requests_namespace():
    from connector.engine.keys import key_fingerprint

    from .fakes import admit_fully, blocks, request, scheduler

    s = scheduler()
    prompt = list(range(1000, 1600))
    _, plain = admit_fully(s, request("a", prompt), blocks(10, 5))
    _, salted = admit_fully(s, request("b", prompt, cache_salt="tenant"), blocks(20, 5))
    base = key_fingerprint(s.state.base_namespace)
    assert plain.stores and {j.namespace for j in plain.stores} == {base}
    (other,) = {j.namespace for j in salted.stores}
    assert other != base and other == key_fingerprint(s.state.policies["b"].namespace)
