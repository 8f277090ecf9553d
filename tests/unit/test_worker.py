"""The worker half against real torch tensors laid out as vLLM lays them out (no vLLM)."""

import os

import pytest
import torch

from connector.config.loading import load_config
from connector.engine.facts import EngineFacts
from connector.engine.jobs import CPU, DISK, ChunkLoad, Eviction, LoadJob, StepPlan, StoreJob
from connector.engine.outcomes import FailureReason, Stage, TierState
from connector.tiers import disk as disk_files
from connector.worker.connector_worker import ConnectorWorker
from connector.worker.kv_blocks import BlockCopier

NUM_BLOCKS, LAYERS, HEADS, BS, HEAD = 16, 3, 2, 16, 8


def cpu_layout() -> dict[str, torch.Tensor]:
    """vLLM 0.32 (CPU and GPU): [num_blocks, heads, block_size, 2*head], all layers one storage."""
    storage = torch.randn(LAYERS, NUM_BLOCKS, HEADS, BS, 2 * HEAD).to(torch.bfloat16)
    return {f"model.layers.{i}.self_attn.attn": storage[i] for i in range(LAYERS)}


def kv_first_layout() -> dict[str, torch.Tensor]:
    """Older flash-attn: [2, num_blocks, block_size, heads, head]."""
    return {f"l{i}": torch.randn(2, NUM_BLOCKS, BS, HEADS, HEAD).to(torch.float16) for i in range(LAYERS)}


def strided_layout() -> dict[str, torch.Tensor]:
    """Block-first logical shape over a physical order where blocks are not outermost."""
    phys = torch.randn(HEADS, NUM_BLOCKS, BS, 2 * HEAD)
    return {f"l{i}": phys.clone().permute(1, 0, 2, 3) for i in range(LAYERS)}


def block(kv: torch.Tensor, b: int) -> torch.Tensor:
    return kv[:, b] if kv.shape[0] == 2 and kv.shape[1] == NUM_BLOCKS else kv[b]


@pytest.mark.parametrize("make", [cpu_layout, kv_first_layout, strided_layout])
def test_gather_then_scatter_moves_whole_blocks_exactly(make):
    src, dst = make(), make()
    cs, cd = BlockCopier(src, NUM_BLOCKS), BlockCopier(dst, NUM_BLOCKS)
    payload = cs.gather([3, 7, 9])
    assert payload.shape == (LAYERS, 3, cs.block_bytes)
    untouched = {n: t.clone() for n, t in dst.items()}
    cd.scatter(payload, [12, 1], first_block=1)  # blocks 7 and 9 of the source
    for name in src:
        assert torch.equal(block(dst[name], 12), block(src[name], 7))
        assert torch.equal(block(dst[name], 1), block(src[name], 9))
        for b in set(range(NUM_BLOCKS)) - {12, 1}:
            assert torch.equal(block(dst[name], b), block(untouched[name], b))


def facts(copier_caches, role="kv_both") -> EngineFacts:
    c = BlockCopier(copier_caches, NUM_BLOCKS)
    return EngineFacts("m", "bf16", BS, LAYERS, c.block_bytes, "layout", 1, role)


def worker(caches, tmp_path=None, **extra) -> ConnectorWorker:
    cfg = {"lmcache.chunk_size": 2 * BS, **{f"lmcache.{k}": v for k, v in extra.items()}}
    if tmp_path is not None:
        cfg.update({"lmcache.local_disk": str(tmp_path), "lmcache.max_local_disk_size": 1})
    w = ConnectorWorker(load_config(cfg, env={}), facts(caches), rank=0)
    w.register(caches, NUM_BLOCKS)
    return w


NAME = "ab" * 16


def test_store_then_load_roundtrip_through_cpu_and_disk(tmp_path):
    caches = cpu_layout()
    w = worker(caches, tmp_path)
    w.save(StepPlan(writes=[StoreJob("a", NAME, (2, 5), (CPU, DISK), 32)]))
    w.flush()
    assert os.path.exists(disk_files.chunk_path(str(tmp_path), f"{NAME}.r0"))
    expected = [caches[n][[2, 5]].clone() for n in caches]
    for tier in (CPU, DISK):
        for t in caches.values():
            t[[8, 9]] = 0
        w.load(StepPlan(loads=[LoadJob("b", (ChunkLoad(NAME, tier, (8, 9), 0, 32),))]))
        assert w.take_failed_blocks() == set()
        for n, exp in zip(caches, expected, strict=True):
            assert torch.equal(caches[n][[8, 9]], exp)
    report = w.take_report()
    assert report.loads["b"].tokens_by_tier() == {DISK: 32} and not report.loads["b"].failures()


def test_missing_chunk_falls_back_to_another_tier(tmp_path):
    caches = cpu_layout()
    w = worker(caches, tmp_path)
    w.save(StepPlan(writes=[StoreJob("a", NAME, (2, 5), (CPU, DISK), 32)]))
    w.save(StepPlan(writes=[Eviction(CPU, NAME)]))
    w.load(StepPlan(loads=[LoadJob("b", (ChunkLoad(NAME, CPU, (8, 9), 0, 32),))]))
    assert w.take_failed_blocks() == set()
    assert torch.equal(caches["model.layers.0.self_attn.attn"][8], caches["model.layers.0.self_attn.attn"][2])
    report = w.take_report()
    assert report.loads["b"].tokens_by_tier() == {DISK: 32}
    (fell_back,) = report.loads["b"].chunks
    assert (fell_back.planned_tier, fell_back.tier, fell_back.reason) == (CPU, DISK, FailureReason.MISSING)


SECOND = "cd" * 16  # the chunk after NAME in the prefix


def two_chunks_on_disk(caches, tmp_path) -> tuple:
    """A disk-only worker that stored request a's two chunks (NAME, then SECOND), written."""
    w = worker(caches, tmp_path, local_cpu=False)
    w.save(
        StepPlan(
            writes=[StoreJob("a", NAME, (0, 1), (DISK,), 32), StoreJob("a", SECOND, (2, 3), (DISK,), 32)]
        )
    )
    w.flush()
    return w, SECOND


def test_corrupt_chunk_fails_its_blocks_and_every_later_chunk(tmp_path):
    caches = cpu_layout()
    w, second = two_chunks_on_disk(caches, tmp_path)
    path = disk_files.chunk_path(str(tmp_path), f"{NAME}.r0")
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    before = {n: t.clone() for n, t in caches.items()}
    w.load(
        StepPlan(
            loads=[
                LoadJob("b", (ChunkLoad(NAME, DISK, (8, 9), 0, 32), ChunkLoad(second, DISK, (10, 11), 0, 32)))
            ]
        )
    )
    assert w.take_failed_blocks() == {8, 9, 10, 11}
    assert w.take_failed_blocks() == set()  # reported once
    for n in caches:  # nothing was written from a corrupt record
        assert torch.equal(caches[n][8], before[n][8])
    outcome = w.take_report().loads["b"]
    first, later = outcome.chunks
    assert (first.name, first.planned_tier, first.reason) == (NAME, DISK, FailureReason.CORRUPT)
    assert later.reason is FailureReason.PREFIX_FAILED and not later.ok
    assert not os.path.exists(path)  # the corrupt record was removed: no rescan brings it back


def test_short_payload_for_the_requested_blocks_is_a_failed_load():
    caches = cpu_layout()
    w = worker(caches)
    w.save(StepPlan(writes=[StoreJob("a", NAME, (2,), (CPU,), 16)]))
    w.load(StepPlan(loads=[LoadJob("b", (ChunkLoad(NAME, CPU, (8, 9), 0, 32),))]))
    assert w.take_failed_blocks() == {8, 9}


def test_store_failure_is_reported_not_raised(tmp_path, monkeypatch):
    caches = cpu_layout()
    w = worker(caches, tmp_path)

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(w.tiers[DISK].inner, "put", full)
    w.save(StepPlan(writes=[StoreJob("a", NAME, (2, 5), (CPU, DISK), 32)]))
    w.flush()  # disk writes happen in the background
    report = w.take_report()
    assert [(f.name, f.tier, f.reason) for f in report.store_failures] == [
        (NAME, DISK, FailureReason.IO_ERROR)
    ]


def test_register_rejects_a_layout_the_scheduler_did_not_plan_for():
    caches = cpu_layout()
    wrong = EngineFacts("m", "bf16", BS, LAYERS + 1, 64, "layout", 1, "kv_both")
    w = ConnectorWorker(load_config({"lmcache.chunk_size": 2 * BS}, env={}), wrong, rank=0)
    with pytest.raises(ValueError, match="layers"):
        w.register(caches, NUM_BLOCKS)


def test_unusable_disk_directory_is_a_config_error_naming_the_key(tmp_path):
    from connector.config.loading import ConfigError

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = {"lmcache.local_disk": str(blocker / "kv"), "lmcache.max_local_disk_size": 1}
    with pytest.raises(ConfigError, match="local_disk"):
        ConnectorWorker(load_config(cfg, env={}), facts(cpu_layout()), rank=0)


def test_a_store_computed_over_a_block_that_failed_to_load_in_the_step_is_withdrawn(tmp_path):
    caches = cpu_layout()
    w = worker(caches, tmp_path)
    w.load(StepPlan(loads=[LoadJob("b", (ChunkLoad(NAME, CPU, (8, 9), 0, 32),))]))  # nothing stored: fails
    other = "ef" * 16
    failures = w.save(
        StepPlan(
            writes=[
                StoreJob("b", other, (10, 11), (CPU, DISK), 32, after_loads=(8, 9)),
                StoreJob("c", NAME, (2, 3), (CPU,), 32, after_loads=(4,)),
            ]
        )
    )
    assert [(f.name, f.tier, f.reason) for f in failures] == [
        (other, CPU, FailureReason.DEPENDENCY_FAILED),
        (other, DISK, FailureReason.DEPENDENCY_FAILED),
    ]
    w.flush()
    assert not os.path.exists(disk_files.chunk_path(str(tmp_path), f"{other}.r0"))
    assert w.tiers[CPU].used_bytes == 2 * LAYERS * w.copier.block_bytes  # only c's chunk
    report = w.take_report()
    assert len(report.store_failures) == 2 and report.loads["b"].failed_block_ids == [8, 9]


def test_blocks_the_plan_cannot_load_are_reported_failed():
    w = worker(cpu_layout())
    w.load(StepPlan(fail_blocks=[5, 6]))
    assert w.take_failed_blocks() == {5, 6}


def test_a_skipped_tier_drops_stores_and_loads_fall_back(tmp_path):
    caches = cpu_layout()
    w = worker(caches, tmp_path)
    w.save(StepPlan(writes=[StoreJob("a", NAME, (2, 5), (CPU, DISK), 32)]))
    w.flush()
    for _ in range(3):
        w.health[DISK].failed(FailureReason.IO_ERROR, "EIO")
    failures = w.save(StepPlan(writes=[StoreJob("a", "ef" * 16, (6, 7), (CPU, DISK), 32)]))
    assert [(f.tier, f.reason) for f in failures] == [(DISK, FailureReason.TIER_UNHEALTHY)]
    w.load(StepPlan(loads=[LoadJob("b", (ChunkLoad(NAME, DISK, (8, 9), 0, 32),))]))
    assert w.take_failed_blocks() == set()  # read from the CPU tier instead
    report = w.take_report()
    assert report.tier_states == {DISK: TierState.SKIPPED}
    assert report.loads["b"].chunks[0].tier == CPU


def test_a_full_background_queue_drops_the_store_without_waiting(tmp_path):
    caches = cpu_layout()
    w = worker(caches, tmp_path, extra_config={"max_pending_write_bytes": 1})
    failures = w.save(StepPlan(writes=[StoreJob("a", NAME, (2, 5), (DISK,), 32)]))
    assert [(f.tier, f.reason) for f in failures] == [(DISK, FailureReason.QUEUE_FULL)]


def test_a_chunk_read_from_disk_is_kept_in_the_cpu_tier_it_was_promoted_to(tmp_path):
    caches = cpu_layout()
    w = worker(caches, tmp_path)
    w.save(StepPlan(writes=[StoreJob("a", NAME, (2, 5), (DISK,), 32)]))
    w.flush()
    w.load(StepPlan(loads=[LoadJob("b", (ChunkLoad(NAME, DISK, (8, 9), 0, 32, promote_to=(CPU,)),))]))
    assert w.tiers[CPU].used_bytes == 2 * LAYERS * w.copier.block_bytes
    missing = "ef" * 16
    w.load(StepPlan(loads=[LoadJob("c", (ChunkLoad(missing, DISK, (10, 11), 0, 32, promote_to=(CPU,)),))]))
    report = w.take_report()
    assert [(f.name, f.tier) for f in report.store_failures] == [(missing, CPU)]  # the index lets it go


def test_the_drop_of_pending_writes_to_zero_is_reported(tmp_path, monkeypatch):
    import threading

    from connector.tiers.disk import DiskTier

    release = threading.Event()
    put = DiskTier.put
    monkeypatch.setattr(
        DiskTier, "put", lambda self, name, payload: (release.wait(10), put(self, name, payload))[1]
    )
    caches = cpu_layout()
    w = worker(caches, tmp_path)
    w.save(StepPlan(writes=[StoreJob("a", NAME, (2, 5), (CPU, DISK), 32)]))
    assert w.take_report().pending_writes == 1
    assert w.take_report().pending_writes == 1  # still queued: said again every step
    release.set()
    assert w.flush(10)
    assert w.take_report().pending_writes == 0  # or the scheduler keeps the engine stepping for 30 s
    assert w.take_report() is None  # nothing changed since


# ---- what the tiers hold and the bytes that moved (counted from the report) -------------
def _files(path) -> list[str]:
    return disk_files.chunk_files(str(path))


def test_a_store_counts_once_the_tier_holds_it_and_a_failed_write_counts_as_failed(tmp_path):
    import resource

    caches = cpu_layout()
    w = worker(caches, tmp_path)
    nbytes = 2 * LAYERS * w.copier.block_bytes
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes // 2, hard))  # the disk refuses the file (EFBIG)
    try:
        w.save(StepPlan(writes=[StoreJob("a", NAME, (2, 5), (CPU, DISK), 32)]))
        queued = w.take_report()  # the disk write may still be queued
        w.flush()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    later = w.take_report()  # None if the write had failed before the first report
    report = queued.merge(later) if later is not None else queued
    assert _files(tmp_path) == []  # what the disk holds: nothing
    stored = {
        t: (x.stored_chunks, x.stored_tokens, x.stored_bytes)
        for t, x in report.traffic.items()
        if x.stored_chunks
    }
    assert stored == {CPU: (1, 32, nbytes)}  # the CPU tier held it at once; the disk never did
    assert [(f.tier, f.reason) for f in report.store_failures] == [(DISK, FailureReason.IO_ERROR)]
    assert "File too large" in report.store_failures[0].detail


def test_a_background_write_is_counted_stored_when_it_lands_with_its_time(tmp_path):
    caches = cpu_layout()
    w = worker(caches, tmp_path)
    nbytes = 2 * LAYERS * w.copier.block_bytes
    w.save(StepPlan(writes=[StoreJob("a", NAME, (2, 5), (CPU, DISK), 32)]))
    w.flush()
    report = w.take_report()
    disk, cpu = report.traffic[DISK], report.traffic[CPU]
    assert (disk.stored_chunks, disk.stored_tokens, disk.stored_bytes) == (1, 32, nbytes)
    (path,) = _files(tmp_path)
    assert os.path.getsize(path) > nbytes  # the record: a header, then the payload
    assert disk.moved[Stage.WRITE].nbytes == nbytes and disk.moved[Stage.WRITE].seconds > 0
    for traffic in (disk, cpu):  # one gather fed both tiers
        assert traffic.moved[Stage.GATHER].nbytes == nbytes and traffic.moved[Stage.GATHER].seconds > 0
    assert Stage.WRITE not in cpu.moved  # the CPU tier keeps the gathered buffer: nothing more moves
    w.take_report()
    w.load(StepPlan(loads=[LoadJob("b", (ChunkLoad(NAME, DISK, (8, 9), 0, 32),))]))
    loads = w.take_report().traffic[DISK].moved
    assert loads[Stage.READ].nbytes == loads[Stage.COPY].nbytes == nbytes
    assert loads[Stage.READ].seconds > 0 and loads[Stage.COPY].seconds > 0


def test_ranks_but_the_first_count_bytes_not_chunks(tmp_path):
    caches = cpu_layout()
    cfg = {"lmcache.chunk_size": 2 * BS}
    w = ConnectorWorker(load_config(cfg, env={}), facts(caches), rank=1)
    w.register(caches, NUM_BLOCKS)
    w.save(StepPlan(writes=[StoreJob("a", NAME, (2, 5), (CPU,), 32)]))
    cpu = w.take_report().traffic[CPU]
    assert (cpu.stored_chunks, cpu.stored_tokens, cpu.stored_bytes) == (
        0,
        0,
        2 * LAYERS * w.copier.block_bytes,
    )


def test_writes_queued_when_their_tier_is_skipped_stay_pending_until_their_outcome_is_reported(
    tmp_path, monkeypatch
):
    """A tier skipped while writes wait in its queue (Redis out of memory three times in a row):
    the report that says 0 pending carries every one of their outcomes, or an engine that goes
    idle never reports them (the scheduler stops stepping once pending drops to 0)."""
    import threading
    import time

    from connector.tiers.disk import DiskTier

    release, tried = threading.Event(), []

    def refusing_put(self, name, payload):
        tried.append(name)
        release.wait(10)
        raise OSError(5, "EIO")

    monkeypatch.setattr(DiskTier, "put", refusing_put)
    caches = cpu_layout()
    w = worker(caches, tmp_path)
    names = [f"{i:02x}" * 16 for i in range(3)]
    for i, name in enumerate(names):
        w.save(StepPlan(writes=[StoreJob("a", name, (2 * i, 2 * i + 1), (DISK,), 32)]))
    deadline = time.monotonic() + 10
    while not tried and time.monotonic() < deadline:  # the first write is in flight
        time.sleep(0.005)
    w.health[DISK].failed(FailureReason.TIMEOUT, "a write has not finished")  # skipped now
    assert w.take_report().pending_writes == 3
    release.set()
    assert w.flush(10)
    report = w.take_report()
    assert report.pending_writes == 0
    assert sorted(f.name for f in report.store_failures) == names
    # the write in flight failed; the ones still queued were not tried against a skipped tier
    assert [n.removesuffix(".r0") for n in tried] == names[:1]
    assert {f.reason for f in report.store_failures[1:]} == {FailureReason.TIER_UNHEALTHY}


def test_a_disk_read_that_times_out_is_a_counted_miss_and_deletes_nothing(tmp_path):
    caches = cpu_layout()
    w, second = two_chunks_on_disk(caches, tmp_path)
    w.take_report()
    paths = [disk_files.chunk_path(str(tmp_path), f"{n}.r0") for n in (NAME, second)]
    w.tiers[DISK].timeout_s = 0.0  # every read misses its deadline (a backlog on the readers)
    w.load(
        StepPlan(
            loads=[
                LoadJob("b", (ChunkLoad(NAME, DISK, (8, 9), 0, 32), ChunkLoad(second, DISK, (10, 11), 0, 32)))
            ]
        )
    )
    assert w.take_failed_blocks() == {8, 9, 10, 11}
    report = w.take_report()
    first, later = report.loads["b"].chunks
    assert first.reason is FailureReason.TIMEOUT and later.reason is FailureReason.PREFIX_FAILED
    assert not report.deleted and all(os.path.exists(p) for p in paths)  # both records kept
