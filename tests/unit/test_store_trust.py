"""A shared store is trusted only as far as it can be: with a store key, a record is loaded only if
a holder of the key wrote it for that chunk; and no length a store announces (a file's size, a
header's payload size) makes the engine allocate more than a chunk of its layout can be."""

from __future__ import annotations

import json
import os
import shutil
import tracemalloc

import pytest
import torch

from connector.config.loading import ConfigError, load_config
from connector.tiers import codec, disk_layers
from connector.tiers import disk as disk_files
from connector.tiers.base import ChunkCorrupt
from connector.tiers.disk import DiskTier
from connector.tiers.record_trust import BLAKE3, MAX_HEADER_BYTES, RecordTrust

A = "0123456789abcdef0123456789abcdef.r0"
B = "fedcba9876543210fedcba9876543210.r0"
LAYOUT = "layout"
L, LAYER_BYTES = 4, 4096
MAX_PAYLOAD = L * LAYER_BYTES  # the largest chunk of this made-up layout
KEY = "a-store-key-of-the-fleet-0001"
SPARSE_BYTES = 100 * 10**9  # a 100 GB file that takes no disk space


def payload(seed: int = 0) -> memoryview:
    return memoryview(bytes((i * 7 + seed) % 256 for i in range(256)) * (MAX_PAYLOAD // 256))


def tier(root, key: str | None = KEY, layers: int = L) -> DiskTier:
    return DiskTier(str(root), LAYOUT, layers=layers, trust=RecordTrust.of(key, MAX_PAYLOAD))


def read_layered(disk: DiskTier, name: str) -> memoryview | BaseException:
    reads = disk_layers.LayeredReads(disk, [name], L, 5.0)
    reads.open_all()
    for layer in range(L):
        reads.read_layer(layer)
    try:
        for layer in range(L):
            reads.wait_layer(0, layer)
    except ChunkCorrupt as e:
        return e
    got = reads.payload(0)
    reads.close()
    return got


class Allocations:
    """Sizes asked of an allocator; one far over a chunk is refused (never really allocated)."""

    def __init__(self, allocate):
        self.asked: list[int] = []
        self._allocate = allocate

    def __call__(self, size=0, *args):
        if isinstance(size, int):
            self.asked.append(size)
            if size > 64 * MAX_PAYLOAD:
                raise MemoryError(f"test refuses to allocate {size} bytes")
        return self._allocate(size, *args)

    @property
    def largest(self) -> int:
        return max(self.asked, default=0)


# ---- sizes announced by the store -----------------------------------------------------------


def test_a_sparse_file_far_larger_than_any_chunk_is_refused_before_it_is_read(tmp_path, monkeypatch):
    disk = tier(tmp_path, key=None, layers=0)
    disk.put(A, payload())
    os.truncate(disk.path(A), SPARSE_BYTES)  # e.g. planted by anyone who can write the directory
    allocations = Allocations(bytearray)
    monkeypatch.setattr(disk_files, "bytearray", allocations, raising=False)
    tracemalloc.start()
    try:
        with pytest.raises(ChunkCorrupt, match="larger than any chunk"):
            disk.get(A)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert allocations.largest <= MAX_PAYLOAD + MAX_HEADER_BYTES, allocations.asked
    # Allocations seen by tracemalloc include other threads' (25 KB on a slowed CPU): a bound
    # 100,000 times below the file's size shows it was not read all the same.
    assert peak < SPARSE_BYTES // 100_000
    assert not os.path.exists(disk.path(A))  # removed as damaged


def _forged(disk: DiskTier, name: str, nbytes: int) -> None:
    """A record whose header announces ``nbytes`` of payload, in a sparse file that long."""
    fields = {"name": name, "layout": LAYOUT, "nbytes": nbytes, "xxh3": "0" * 32, "lx": ["0" * 16] * L}
    header = json.dumps(fields).encode()
    record = codec.MAGIC + len(header).to_bytes(4, "little") + header
    path = disk.path(name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(record)
    os.truncate(path, len(record) + nbytes)


def test_a_header_announcing_a_huge_payload_is_refused_before_a_buffer_is_taken(tmp_path, monkeypatch):
    disk = tier(tmp_path, key=None)
    _forged(disk, A, SPARSE_BYTES // L * L)
    allocations = Allocations(disk.read_buffers.take)
    monkeypatch.setattr(disk.read_buffers, "take", allocations)
    got = read_layered(disk, A)
    assert allocations.largest <= MAX_PAYLOAD, allocations.asked
    assert isinstance(got, ChunkCorrupt) and "larger than any chunk" in str(got)
    assert not os.path.exists(disk.path(A))  # removed as damaged
    _forged(disk, A, SPARSE_BYTES // L * L)
    with pytest.raises(ChunkCorrupt, match="larger than any chunk"):
        disk.get(A)  # a whole read refuses the file's size


def test_a_header_longer_than_any_records_is_refused_unread():
    prefix = codec.MAGIC + (2**31).to_bytes(4, "little") + b"{}"
    with pytest.raises(ChunkCorrupt, match="longer than any"):
        codec.check_header(prefix, A, LAYOUT, RecordTrust(None, MAX_PAYLOAD))


def test_records_of_the_largest_chunk_still_load(tmp_path):
    disk = tier(tmp_path)
    disk.put(A, payload())
    assert bytes(disk.get(A)) == bytes(payload())
    assert bytes(read_layered(disk, A)) == bytes(payload())


# ---- who wrote it ---------------------------------------------------------------------------


@pytest.mark.parametrize("writer_key", [None, "another-fleets-key-0002"])
@pytest.mark.parametrize("layerwise", [False, True])
def test_with_a_store_key_a_record_written_without_it_is_refused_and_removed(tmp_path, writer_key, layerwise):
    tier(tmp_path, key=writer_key).put(A, payload(1))  # a computable name, valid checksums
    reader = tier(tmp_path)
    got = read_layered(reader, A) if layerwise else _get(reader, A)
    assert isinstance(got, ChunkCorrupt) and "store_auth_key" in str(got)
    assert not os.path.exists(reader.path(A))  # counted as corrupt, removed, recomputed


def _get(disk: DiskTier, name: str) -> memoryview | BaseException:
    try:
        return disk.get(name)
    except ChunkCorrupt as e:
        return e


@pytest.mark.parametrize("layerwise", [False, True])
def test_with_the_right_key_a_record_loads_and_a_reader_without_a_key_loads_it_too(tmp_path, layerwise):
    tier(tmp_path).put(A, payload(2))
    for reader in (tier(tmp_path), tier(tmp_path, key=None)):
        got = read_layered(reader, A) if layerwise else reader.get(A)
        assert bytes(got) == bytes(payload(2))


def _rewrite_header(path: str, change) -> None:
    with open(path, "rb") as f:
        record = f.read()
    end = codec.header_length(record)
    fields = json.loads(record[codec.PREFIX_BYTES : end])
    change(fields, memoryview(record)[end:])
    header = json.dumps(fields, separators=(",", ":")).encode()
    with open(path, "wb") as f:
        f.write(codec.MAGIC + len(header).to_bytes(4, "little") + header + record[end:])


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_tagged_record_moved_under_another_chunks_name_is_refused(tmp_path, layerwise):
    writer = tier(tmp_path)
    writer.put(B, payload(3))
    os.makedirs(os.path.dirname(writer.path(A)), exist_ok=True)
    shutil.copyfile(writer.path(B), writer.path(A))
    _rewrite_header(writer.path(A), lambda fields, _: fields.update(name=A))  # names match again
    assert bytes(tier(tmp_path, key=None).get(A)) == bytes(payload(3))  # without a key: steered
    got = read_layered(tier(tmp_path), A) if layerwise else _get(tier(tmp_path), A)
    assert isinstance(got, ChunkCorrupt) and "store_auth_key" in str(got)


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_tagged_records_payload_changed_with_its_digests_is_refused(tmp_path, layerwise):
    writer = tier(tmp_path)
    writer.put(A, payload(4))
    path = writer.path(A)
    with open(path, "r+b") as f:  # the attacker's KV in layer 0...
        f.seek(-MAX_PAYLOAD, os.SEEK_END)
        f.write(b"\xff" * 64)

    def redigest(fields, body):  # ...and digests that match it (no key needed for those)
        fields["b3"] = BLAKE3.whole(body)
        fields["lb3"] = [BLAKE3.layer(body[i * LAYER_BYTES : (i + 1) * LAYER_BYTES]) for i in range(L)]

    _rewrite_header(path, redigest)
    assert bytes(tier(tmp_path, key=None).get(A))[:64] == b"\xff" * 64  # without a key: steered
    got = read_layered(tier(tmp_path), A) if layerwise else _get(tier(tmp_path), A)
    assert isinstance(got, ChunkCorrupt) and "store_auth_key" in str(got)


def test_the_tag_binds_what_a_reader_relies_on():
    trust = RecordTrust.of(KEY, MAX_PAYLOAD)
    header = codec.encode_header(A, LAYOUT, payload(5), "ns-1", L, trust)
    record = bytearray(header) + bytes(payload(5))
    assert bytes(codec.decode(record, A, LAYOUT, trust)) == bytes(payload(5))
    fields = json.loads(header[codec.PREFIX_BYTES :])
    assert fields["mac"] == trust.tag(fields)
    for field, value in (("layout", "other"), ("nbytes", 1), ("ns", "ns-2"), ("t", 1), ("name", B)):
        assert trust.tag({**fields, field: value}) != fields["mac"], field
    assert RecordTrust.of("another-fleets-key-0002").tag(fields) != fields["mac"]
    assert KEY not in repr(trust) and KEY.encode() not in repr(trust).encode()


# ---- configuration --------------------------------------------------------------------------


def test_the_store_key_comes_from_extra_config_a_file_or_the_environment(tmp_path):
    base = {"lmcache.local_disk": str(tmp_path / "kv"), "lmcache.max_local_disk_size": 1}
    assert load_config(base, env={}).store_auth_key is None
    c = load_config({**base, "lmcache.extra_config": {"store_auth_key": KEY}}, env={})
    assert c.store_auth_key == KEY.encode() and KEY not in str(c.summary())
    keyfile = tmp_path / "key"
    keyfile.write_text(KEY + "\n")
    c = load_config({**base, "lmcache.extra_config": {"store_auth_key_file": str(keyfile)}}, env={})
    assert c.store_auth_key == KEY.encode()
    assert load_config(base, env={"KVLENS_STORE_AUTH_KEY": KEY}).store_auth_key == KEY.encode()


@pytest.mark.parametrize(
    "extra, env",
    [
        ({"store_auth_key": "short"}, {}),
        ({"store_auth_key": KEY, "store_auth_key_file": "/x"}, {}),
        ({"store_auth_key_file": "/no/such/file"}, {}),
        ({}, {"KVLENS_STORE_AUTH_KEY": "short"}),
    ],
)
def test_a_weak_or_unreadable_store_key_stops_start_up(tmp_path, extra, env):
    config = {
        "lmcache.local_disk": str(tmp_path),
        "lmcache.max_local_disk_size": 1,
        "lmcache.extra_config": extra,
    }
    with pytest.raises(ConfigError, match="store_auth_key|KVLENS_STORE_AUTH_KEY"):
        load_config(config, env=env)


# ---- an engine ------------------------------------------------------------------------------


def test_an_engine_with_a_store_key_loads_its_own_records_and_refuses_planted_ones(tmp_path):
    from connector.engine.jobs import DISK, ChunkLoad, LoadJob, StepPlan, StoreJob
    from connector.engine.outcomes import FailureReason

    from .test_worker import cpu_layout, worker

    ours, planted = "ab" * 16, "cd" * 16
    caches = cpu_layout()
    keyed = worker(caches, tmp_path, local_cpu=False, extra_config={"store_auth_key": KEY})
    assert keyed.tiers[DISK].inner.trust.max_payload_bytes == keyed.facts.chunk_nbytes(
        keyed.config.chunk_size
    )
    keyless = worker(caches, tmp_path, local_cpu=False)  # e.g. an engine of someone else's
    keyed.save(StepPlan(writes=[StoreJob("a", ours, (0, 1), (DISK,), 32)]))
    keyless.save(StepPlan(writes=[StoreJob("a", planted, (2, 3), (DISK,), 32)]))
    keyed.flush()
    keyless.flush()
    before = {n: t[[10, 11]].clone() for n, t in caches.items()}
    keyed.load(
        StepPlan(
            loads=[
                LoadJob("b", (ChunkLoad(ours, DISK, (8, 9), 0, 32),)),
                LoadJob("c", (ChunkLoad(planted, DISK, (10, 11), 0, 32),)),
            ]
        )
    )
    assert keyed.take_failed_blocks() == {10, 11}
    for n, t in caches.items():
        assert torch.equal(t[8], t[0]) and torch.equal(t[[10, 11]], before[n])
    (refused,) = keyed.take_report().loads["c"].chunks
    assert refused.reason is FailureReason.CORRUPT
    assert not os.path.exists(disk_files.chunk_path(str(tmp_path), f"{planted}.r0"))
