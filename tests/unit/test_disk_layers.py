"""Disk records read a layer at a time: layer 0 is usable before the last layer is read, each
layer is checked before it is used, and a damaged layer fails its chunk (and the chunks after
it) without a wrong block ever being handed to vLLM as loaded."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import pytest
import torch

from connector.engine.health import TierHealth
from connector.engine.jobs import CPU, DISK, ChunkLoad, LoadJob, StepPlan, StoreJob
from connector.engine.outcomes import FailureReason
from connector.tiers import codec, disk_layers
from connector.tiers import disk as disk_files
from connector.tiers.background import BackgroundTier
from connector.tiers.base import ChunkCorrupt, ChunkMissing
from connector.tiers.disk import DiskTier

from .test_worker import LAYERS, NAME, cpu_layout, worker

RECORD = "0123456789abcdef0123456789abcdef.r0"
L, LAYER_BYTES = 4, 4096


def payload() -> memoryview:
    return memoryview(bytes(range(256)) * (L * LAYER_BYTES // 256))


def flip(path: str, offset_from_end: int) -> None:
    """Flip one byte of the file in place (``offset_from_end`` bytes before its end)."""
    with open(path, "r+b") as f:
        f.seek(-offset_from_end, os.SEEK_END)
        byte = f.read(1)
        f.seek(-offset_from_end, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


def layered(tier: DiskTier, names, timeout_s: float = 5.0) -> disk_layers.LayeredReads:
    reads = disk_layers.LayeredReads(tier, names, L, timeout_s)
    reads.open_all()
    for layer in range(L):
        reads.read_layer(layer)
    return reads


def test_a_record_carries_a_checksum_per_layer_and_reads_back_exactly(tmp_path):
    tier = DiskTier(str(tmp_path), "layout", layers=L)
    tier.put(RECORD, payload())
    with open(tier.path(RECORD), "rb") as f:
        header = codec.check_header(f.read(codec.HEADER_PEEK_BYTES), RECORD, "layout")
    assert header.layers is not None and len(header.layers) == L
    reads = layered(tier, [RECORD])
    for layer in range(L):
        reads.wait_layer(0, layer)
    assert bytes(reads.payload(0)) == bytes(payload())
    assert bytes(tier.get(RECORD)) == bytes(payload())  # whole reads check the whole checksum


def test_a_record_without_layer_checksums_is_read_and_checked_whole(tmp_path):
    DiskTier(str(tmp_path), "layout").put(RECORD, payload())  # as versions before lx wrote it
    reads = layered(DiskTier(str(tmp_path), "layout", layers=L), [RECORD])
    reads.wait_layer(0, L - 1)
    assert bytes(reads.payload(0)) == bytes(payload())


@pytest.mark.parametrize("layerwise", [True, False])
def test_a_flipped_bit_in_the_last_layer_fails_only_from_that_layer_and_removes_the_record(
    tmp_path, layerwise
):
    tier = DiskTier(str(tmp_path), "layout", layers=L if layerwise else 0)
    tier.put(RECORD, payload())
    flip(tier.path(RECORD), 10)
    reads = layered(DiskTier(str(tmp_path), "layout", layers=L), [RECORD])
    if layerwise:  # the earlier layers were checked on their own
        for layer in range(L - 1):
            reads.wait_layer(0, layer)
    with pytest.raises(ChunkCorrupt):
        reads.wait_layer(0, L - 1)
    assert not os.path.exists(tier.path(RECORD))


@pytest.mark.parametrize(
    "damage",
    ["missing", "truncated", "appended", "other layer count"],
)
def test_a_record_that_cannot_be_read_fails_at_its_header(tmp_path, damage):
    tier = DiskTier(str(tmp_path), "layout", layers=L)
    tier.put(RECORD, payload())
    path = tier.path(RECORD)
    if damage == "missing":
        os.unlink(path)
    elif damage == "truncated":
        os.truncate(path, os.path.getsize(path) - 1)
    elif damage == "appended":
        with open(path, "ab") as f:
            f.write(b"\0")
    else:
        DiskTier(str(tmp_path), "layout", layers=2).put(RECORD, payload())
    reads = layered(tier, [RECORD])
    error = reads.payload(0)
    assert isinstance(error, ChunkMissing if damage == "missing" else ChunkCorrupt)
    with pytest.raises(type(error)):
        reads.wait_layer(0, 0)


def test_layer_0_is_usable_while_the_last_layer_is_still_being_read(tmp_path, monkeypatch):
    tier = DiskTier(str(tmp_path), "layout", layers=L)
    tier.put(RECORD, payload())
    release = threading.Event()
    read = disk_layers._read_exactly
    header_end = os.path.getsize(tier.path(RECORD)) - L * LAYER_BYTES

    def slow_last_layer(fd, view, offset, name):
        if offset >= header_end + (L - 1) * LAYER_BYTES:
            release.wait(10)
        read(fd, view, offset, name)

    monkeypatch.setattr(disk_layers, "_read_exactly", slow_last_layer)
    background = BackgroundTier(tier, TierHealth(DISK), timeout_s=10.0)
    try:
        record = background.get_layered([RECORD], L).record(0)
        started = time.monotonic()
        assert not isinstance(record.payload(), BaseException)
        record.wait_layer(0)
        assert time.monotonic() - started < 5
        assert bytes(record.payload()[:LAYER_BYTES]) == bytes(payload()[:LAYER_BYTES])
        release.set()
        record.wait_layer(L - 1)
        assert bytes(record.payload()) == bytes(payload())
    finally:
        release.set()
        background.close()


def test_a_hung_read_fails_its_layer_within_the_tier_timeout(tmp_path, monkeypatch):
    tier = DiskTier(str(tmp_path), "layout", layers=L)
    tier.put(RECORD, payload())
    release = threading.Event()
    read = disk_layers._read_exactly
    monkeypatch.setattr(
        disk_layers,
        "_read_exactly",
        lambda fd, view, offset, name: (release.wait(10), read(fd, view, offset, name)),
    )
    background = BackgroundTier(tier, TierHealth(DISK), timeout_s=0.3)
    try:
        record = background.get_layered([RECORD], L).record(0)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            record.wait_layer(0)
        assert time.monotonic() - started < 2
    finally:
        release.set()
        background.close()


# ---- through the worker: in the step and outside it -----------------------------------------


def _two_chunks_on_disk(tmp_path, **extra):
    caches = cpu_layout()
    w = worker(caches, tmp_path, **extra)
    second = "cd" * 16
    w.save(
        StepPlan(
            writes=[StoreJob("a", NAME, (0, 1), (DISK,), 32), StoreJob("a", second, (2, 3), (DISK,), 32)]
        )
    )
    w.flush()
    return caches, w, second


def _load_job(second: str) -> LoadJob:
    return LoadJob(
        "b",
        (
            ChunkLoad(NAME, DISK, (8, 9), 0, 32, promote_to=(CPU,)),
            ChunkLoad(second, DISK, (10, 11), 0, 32, promote_to=(CPU,)),
        ),
    )


def _flip_last_layer(tmp_path, name: str) -> None:
    flip(disk_files.chunk_path(str(tmp_path), f"{name}.r0"), 3)


def _load_outside_step(w, job: LoadJob) -> None:
    w.start_load(StepPlan(step=1, async_loads=[job]))
    deadline = time.monotonic() + 10
    while "b" not in w.take_finished_loads(idle=True)[0]:
        assert time.monotonic() < deadline, "the load never finished"


@pytest.mark.parametrize("outside_step", [False, True])
def test_a_damaged_last_layer_fails_its_chunk_and_later_ones_and_promotes_neither(tmp_path, outside_step):
    caches, w, second = _two_chunks_on_disk(tmp_path)
    _flip_last_layer(tmp_path, NAME)
    dependent = StoreJob("b", "ef" * 16, (12, 13), (CPU,), 32, after_loads=(8, 9, 10, 11))
    if outside_step:
        _load_outside_step(w, _load_job(second))
    else:  # a store computed in the same step over the failed blocks is withdrawn
        plan = StepPlan(step=1, loads=[_load_job(second)], writes=[dependent])
        w.start_load(plan)
        w.finish_load()
        assert [f.reason for f in w.save(plan)] == [FailureReason.DEPENDENCY_FAILED]
    assert w.take_failed_blocks() == {8, 9, 10, 11}
    report = w.take_report()
    first, later = report.loads["b"].chunks
    assert (first.reason, later.reason) == (FailureReason.CORRUPT, FailureReason.PREFIX_FAILED)
    assert w.tiers[CPU].used_bytes == 0  # no chunk that was not read whole went to the CPU tier
    promoted = {(f.name, f.tier) for f in report.store_failures}
    assert {(NAME, CPU), (second, CPU)} <= promoted  # the index lets the admissions go


@pytest.mark.parametrize("outside_step", [False, True])
def test_a_disk_load_read_layer_by_layer_is_exact_and_promoted(tmp_path, outside_step):
    caches, w, second = _two_chunks_on_disk(tmp_path)
    expected = {n: t[[0, 1, 2, 3]].clone() for n, t in caches.items()}
    if outside_step:
        _load_outside_step(w, _load_job(second))
    else:
        w.load(StepPlan(step=1, loads=[_load_job(second)]))
    assert w.take_failed_blocks() == set()
    for n, t in caches.items():
        assert torch.equal(t[[8, 9, 10, 11]], expected[n])
    assert w.tiers[CPU].used_bytes == 4 * LAYERS * w.copier.block_bytes
    assert not w.take_report().store_failures


# ---- straight into the KV cache ---------------------------------------------------------------


def _targets(kv: bytearray) -> list[list[tuple[int, memoryview]]]:
    """Each layer of a record into its own range of ``kv``, in two runs (as two block runs)."""
    view, half = memoryview(kv), LAYER_BYTES // 2
    return [
        [
            (0, view[i * LAYER_BYTES : i * LAYER_BYTES + half]),
            (half, view[i * LAYER_BYTES + half : (i + 1) * LAYER_BYTES]),
        ]
        for i in range(L)
    ]


@pytest.mark.parametrize("page_cached", [True, False])
def test_a_record_is_read_straight_into_its_targets_and_checked_there(tmp_path, page_cached):
    tier = DiskTier(str(tmp_path), "layout", layers=L)
    tier.put(RECORD, payload())
    tier.reads_nowait = page_cached  # False: every layer through a buffer, then copied in
    kv = bytearray(L * LAYER_BYTES)
    reads = disk_layers.LayeredReads(tier, [RECORD], L, 5.0, targets=[_targets(kv)])
    reads.open_all()
    assert reads.payload(0) is None  # nothing for the consumer to copy
    for layer in range(L):
        reads.read_layer(layer)
    reads.wait_layer(0, L - 1)
    assert bytes(kv) == bytes(payload())


def test_a_damaged_layer_read_into_the_kv_cache_fails_there(tmp_path):
    tier = DiskTier(str(tmp_path), "layout", layers=L)
    tier.put(RECORD, payload())
    flip(tier.path(RECORD), LAYER_BYTES + 5)  # in layer L - 2
    reads = layered_into(tier, bytearray(L * LAYER_BYTES))
    reads.wait_layer(0, L - 3)
    with pytest.raises(ChunkCorrupt):
        reads.wait_layer(0, L - 2)


def layered_into(tier: DiskTier, kv: bytearray) -> disk_layers.LayeredReads:
    reads = disk_layers.LayeredReads(tier, [RECORD], L, 5.0, targets=[_targets(kv)])
    reads.open_all()
    for layer in range(L):
        reads.read_layer(layer)
    return reads


def test_no_read_writes_into_the_kv_cache_once_the_load_is_given_up(tmp_path, monkeypatch):
    """A read from the device that outlives its timeout lands in a buffer; once the consumer
    closed the reads (its blocks may be vLLM's to reuse), nothing is copied into them."""
    tier = DiskTier(str(tmp_path), "layout", layers=L)
    tier.put(RECORD, payload())
    tier.reads_nowait = False  # as if nothing were in the page cache
    release = threading.Event()
    read = disk_layers._read_exactly

    def hung(fd, view, offset, name):
        release.wait(10)
        read(fd, view, offset, name)

    monkeypatch.setattr(disk_layers, "_read_exactly", hung)
    kv = bytearray(L * LAYER_BYTES)
    background = BackgroundTier(tier, TierHealth(DISK), timeout_s=0.3)
    try:
        record = background.get_layered([RECORD], L, [_targets(kv)]).record(0)
        assert record.payload() is None
        with pytest.raises(TimeoutError):
            record.wait_layer(0)
        record.reads.close()
        release.set()  # the reads come back now, into buffers, and stop there
        done = background.run(lambda: None)  # queued behind every layer's read
        done.result(timeout=10)
        done = background.run(lambda: None)  # (two reader threads)
        done.result(timeout=10)
        assert bytes(kv) == bytes(len(kv))  # never written
    finally:
        release.set()
        background.close()


def test_closing_the_reads_waits_for_a_write_into_the_kv_cache_under_way(tmp_path, monkeypatch):
    tier = DiskTier(str(tmp_path), "layout", layers=L)
    tier.put(RECORD, payload())
    writing, written = threading.Event(), threading.Event()
    cached = disk_layers._read_cached

    def slow_copy(fd, runs, offset, t):
        writing.set()
        time.sleep(0.3)
        ok = cached(fd, runs, offset, t)
        written.set()
        return ok

    monkeypatch.setattr(disk_layers, "_read_cached", slow_copy)
    reads = disk_layers.LayeredReads(tier, [RECORD], L, 5.0, targets=[_targets(bytearray(L * LAYER_BYTES))])
    reads.open_all()
    worker_thread = threading.Thread(target=reads.read_layer, args=(0,))
    worker_thread.start()
    assert writing.wait(5)
    reads.close()
    assert written.is_set()  # close returned only after the write under way ended
    worker_thread.join(5)
    writing.clear()
    reads.read_layer(1)  # after close: no read writes into the KV cache any more
    assert not writing.is_set()


@pytest.mark.parametrize("outside_step", [False, True])
def test_a_disk_load_straight_into_the_kv_cache_is_exact_and_a_damaged_one_fails(tmp_path, outside_step):
    caches, w, second = _two_chunks_on_disk(tmp_path, local_cpu=False)
    expected = {n: t[[0, 1, 2, 3]].clone() for n, t in caches.items()}
    job = LoadJob("b", (ChunkLoad(NAME, DISK, (8, 9), 0, 32), ChunkLoad(second, DISK, (10, 11), 0, 32)))
    load = (
        (lambda j: _load_outside_step(w, j))
        if outside_step
        else (lambda j: w.load(StepPlan(step=1, loads=[j])))
    )
    load(job)
    assert w.take_failed_blocks() == set()
    for n, t in caches.items():
        assert torch.equal(t[[8, 9, 10, 11]], expected[n])
    assert w.take_report().loads["b"].tokens_by_tier() == {DISK: 64}
    _flip_last_layer(tmp_path, second)
    load(dataclasses.replace(job, request_id="b"))
    assert w.take_failed_blocks() == {10, 11}
    first, damaged = w.take_report().loads["b"].chunks
    assert first.ok and damaged.reason is FailureReason.CORRUPT


def test_a_model_with_many_layers_has_a_header_longer_than_the_first_read(tmp_path):
    layers, size = 300, 64
    data = memoryview(bytes(range(256)) * (layers * size // 256))
    tier = DiskTier(str(tmp_path), "layout", layers=layers)
    tier.put(RECORD, data)
    reads = disk_layers.LayeredReads(tier, [RECORD], layers, 5.0)
    reads.open_all()
    for layer in range(layers):
        reads.read_layer(layer)
    reads.wait_layer(0, layers - 1)
    assert bytes(reads.payload(0)) == bytes(data)


def test_a_damaged_layer_0_fails_the_layer_never_the_open(tmp_path):
    """Had ``payload`` reported a failed layer 0, the worker would load the chunk from another
    tier into the same blocks while a read of a later layer could still be writing into them."""
    tier = DiskTier(str(tmp_path), "layout", layers=L)
    tier.put(RECORD, payload())
    flip(tier.path(RECORD), L * LAYER_BYTES - 3)  # in layer 0
    kv = bytearray(L * LAYER_BYTES)
    reads = layered_into(tier, kv)  # every layer read before the consumer asks
    assert reads.payload(0) is None  # opened: its layers were for the KV cache
    with pytest.raises(ChunkCorrupt):
        reads.wait_layer(0, 0)
    buffered = layered(DiskTier(str(tmp_path), "layout", layers=L), [RECORD])
    assert isinstance(buffered.payload(0), BaseException)  # the corrupt record was removed


def test_a_record_whose_payload_timed_out_never_writes_into_the_kv_cache(tmp_path, monkeypatch):
    """The consumer gave up on a record at ``payload()`` (its header took too long) and loads
    that chunk from another tier into the same blocks: a late read of the record must not land
    there (its bytes were never checked against what the consumer reports loaded)."""
    tier = DiskTier(str(tmp_path), "layout", layers=L)
    tier.put(RECORD, payload())
    release = threading.Event()
    open_record = tier.open_record

    def slow_open(name):
        release.wait(10)
        return open_record(name)

    monkeypatch.setattr(tier, "open_record", slow_open)
    kv = bytearray(L * LAYER_BYTES)
    background = BackgroundTier(tier, TierHealth(DISK), timeout_s=0.3)
    try:
        reads = background.get_layered([RECORD], L, [_targets(kv)])
        assert isinstance(reads.payload(0), TimeoutError)
        kv[:] = b"\x07" * len(kv)  # what the consumer loaded from elsewhere
        release.set()  # the record opens now and its layers are read
        assert all(layer.wait(10) for layer in reads._layers)
        assert bytes(kv) == b"\x07" * len(kv)
    finally:
        release.set()
        background.close()


@pytest.mark.parametrize("outside_step", [False, True])
def test_a_load_whose_reading_raises_closes_its_reads_and_fails_whole(tmp_path, outside_step, monkeypatch):
    """The reads straight into the KV cache started for the first chunk are closed (no write
    into its blocks after), the load fails whole, and nothing raises into vLLM."""
    caches, w, second = _two_chunks_on_disk(tmp_path, local_cpu=False)
    disk = w.tiers[DISK]
    started: list[disk_layers.LayeredReads] = []
    get_layered = disk.get_layered

    def recording(*args, **kwargs):
        started.append(get_layered(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(disk, "get_layered", recording)
    read_chunk = w.reads._read_chunk

    def raising(chunk, *args, **kwargs):
        if chunk.name == second:
            raise RuntimeError("a bug while reading")
        return read_chunk(chunk, *args, **kwargs)

    monkeypatch.setattr(w.reads, "_read_chunk", raising)
    job = LoadJob("b", (ChunkLoad(NAME, DISK, (8, 9), 0, 32), ChunkLoad(second, DISK, (10, 11), 0, 32)))
    if outside_step:
        _load_outside_step(w, job)
    else:
        w.load(StepPlan(step=1, loads=[job]))
    assert started and all(reads._closed for reads in started)
    assert w.take_failed_blocks() == {8, 9, 10, 11}
    assert [c.reason for c in w.take_report().loads["b"].chunks] == [
        FailureReason.IO_ERROR,
        FailureReason.PREFIX_FAILED,
    ]


@pytest.mark.parametrize("page_cached", [True, False])
def test_a_damaged_layer_read_into_the_kv_cache_leaves_none_of_its_bytes_there(tmp_path, page_cached):
    """vLLM reuses blocks without clearing them, and a block's unused slots are read by the
    attention kernel (random bytes as bf16 hold NaNs that poison every answer over that
    block): a layer that fails its check leaves nothing of itself in the blocks."""
    tier = DiskTier(str(tmp_path), "layout", layers=L)
    tier.put(RECORD, payload())
    path = tier.path(RECORD)
    with open(path, "r+b") as f:  # random bytes over the middle of layer L - 2, size kept
        f.seek(os.path.getsize(path) - 2 * LAYER_BYTES + LAYER_BYTES // 4)
        f.write(os.urandom(LAYER_BYTES // 2))
    tier.reads_nowait = page_cached
    kv = bytearray(b"\x07" * (L * LAYER_BYTES))  # what vLLM's blocks held before
    reads = layered_into(tier, kv)
    with pytest.raises(ChunkCorrupt):
        reads.wait_layer(0, L - 2)
    damaged = bytes(kv[(L - 2) * LAYER_BYTES : (L - 1) * LAYER_BYTES])
    assert damaged in (b"\x07" * LAYER_BYTES, bytes(LAYER_BYTES))
    assert bytes(kv[: (L - 2) * LAYER_BYTES]) == bytes(payload()[: (L - 2) * LAYER_BYTES])  # checked ones


def test_a_layer_read_only_partly_from_the_page_cache_and_then_found_damaged_leaves_nothing(
    tmp_path, monkeypatch
):
    """The page cache held the first run of a layer (read straight into its block), the rest
    came from the device, and the layer fails its check: the first run's bytes go too."""
    tier = DiskTier(str(tmp_path), "layout", layers=L)
    tier.put(RECORD, payload())
    path = tier.path(RECORD)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - LAYER_BYTES + 7)  # in the first run of the last layer
        f.write(os.urandom(64))
    preadv = os.preadv

    def first_run_cached(fd, buffers, offset, flags=0):
        if flags and offset % LAYER_BYTES != os.path.getsize(path) % LAYER_BYTES:  # not a layer's start
            raise BlockingIOError
        return preadv(fd, buffers, offset, flags) if not flags else preadv(fd, buffers, offset)

    monkeypatch.setattr(disk_layers.os, "preadv", first_run_cached)
    kv = bytearray(b"\x07" * (L * LAYER_BYTES))
    reads = layered_into(tier, kv)
    with pytest.raises(ChunkCorrupt):
        reads.wait_layer(0, L - 1)
    last = bytes(kv[(L - 1) * LAYER_BYTES :])
    assert last in (b"\x07" * LAYER_BYTES, bytes(LAYER_BYTES))


@pytest.mark.parametrize("outside_step", [False, True])
def test_random_bytes_over_a_records_middle_never_reach_vllms_blocks(tmp_path, outside_step):
    """Issue 26's damage (random bytes over the middle of every record, sizes kept) loaded by
    the worker, in the step and outside it: the failed chunk's blocks hold the chunk's own KV
    (layers checked before the damaged one) or zeros, never a damaged byte (NaNs as bf16)."""
    caches, w, second = _two_chunks_on_disk(tmp_path, local_cpu=False)
    truth = {n: t[[0, 1, 2, 3]].clone() for n, t in caches.items()}  # what blocks 8..11 load
    for name in (NAME, second):
        path = disk_files.chunk_path(str(tmp_path), f"{name}.r0")
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            f.write(os.urandom(256))
    for t in caches.values():
        t[8:12] = 7.0  # what vLLM's blocks held before
    job = LoadJob("b", (ChunkLoad(NAME, DISK, (8, 9), 0, 32), ChunkLoad(second, DISK, (10, 11), 0, 32)))
    if outside_step:
        _load_outside_step(w, job)
    else:
        w.load(StepPlan(step=1, loads=[job]))
    assert w.take_failed_blocks() == {8, 9, 10, 11}
    for n, t in caches.items():
        for i, b in enumerate((8, 9, 10, 11)):
            got = t[b]
            assert torch.equal(got, truth[n][i]) or not got.any() or bool((got == 7.0).all()), n
        assert not t[8:12].float().isnan().any()
