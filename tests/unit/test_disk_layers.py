"""Disk records read a layer at a time: layer 0 is usable before the last layer is read, each
layer is checked before it is used, and a damaged layer fails its chunk (and the chunks after
it) without a wrong block ever being handed to vLLM as loaded."""

from __future__ import annotations

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
