"""The disk tier's scrub: records damaged in place (no directory time moves, so no rescan sees
it) are found before a load does: those written with one a load found damaged at once, the
rest by a walk bounded in bytes per second (issue 26, item 10)."""

import os
import time

from connector.engine.keys import storage_name
from connector.scheduler.disk_scrub import DiskScrubber
from connector.tiers.disk import DiskTier
from connector.tiers.disk_scan import DirectoryScanner

LAYOUT = "test-layout"


def _digest(i: int) -> str:
    return f"{i:032x}"


def _store(disk: DiskTier, digests, world: int = 1) -> None:
    for d in digests:
        for rank in range(world):
            disk.put(storage_name(d, rank), memoryview(bytes([len(d) % 251]) * 4096))


def _damage(disk: DiskTier, digest: str, rank: int = 0) -> None:
    """Overwrite the middle of the record in place: size, directory and its time unchanged."""
    with open(disk.path(storage_name(digest, rank)), "r+b") as f:
        f.seek(os.fstat(f.fileno()).st_size // 2)
        f.write(os.urandom(64))


def _scrubber(tmp_path, n=6, world=1, rate=0.0):
    disk = DiskTier(str(tmp_path), LAYOUT)
    digests = [_digest(i) for i in range(n)]
    _store(disk, digests, world)
    scanner = DirectoryScanner(str(tmp_path), world)
    scanner.scan()
    return disk, digests, DiskScrubber(disk, scanner.chunks, world, rate, start=False, min_age_s=0)


def test_a_record_damaged_in_place_is_found_removed_and_handed_over(tmp_path):
    disk, digests, scrub = _scrubber(tmp_path)
    _damage(disk, digests[2])
    good = disk.path(storage_name(digests[1], 0))
    atime = os.stat(good).st_atime_ns
    assert scrub.verify(digests[1]) > 0 and scrub.take_damaged() == []
    assert os.stat(good).st_atime_ns == atime  # a verifying read is not a use
    scrub.verify(digests[2])
    assert scrub.take_damaged() == [digests[2]] and scrub.damaged_found == 1
    assert not os.path.exists(disk.path(storage_name(digests[2], 0)))
    assert scrub.take_damaged() == []  # handed over once


def test_any_ranks_damaged_record_makes_the_chunk_damaged(tmp_path):
    disk, digests, scrub = _scrubber(tmp_path, n=2, world=2)
    _damage(disk, digests[0], rank=1)
    scrub.verify(digests[0])
    assert scrub.take_damaged() == [digests[0]] and scrub.scrubbed_records == 2


def test_a_damaged_load_has_the_records_written_with_it_verified_first_even_with_the_walk_off(tmp_path):
    disk, digests, scrub = _scrubber(tmp_path, n=6, rate=0.0)
    for d in digests[1:]:
        _damage(disk, d)
    scrub.load_found_damaged(digests[0], others=[digests[1]])
    while scrub.work() is not None:
        pass
    assert sorted(scrub.take_damaged()) == sorted(digests[1:])


def test_records_written_long_apart_are_left_to_the_walk(tmp_path):
    disk, digests, scrub = _scrubber(tmp_path, n=3, rate=0.0)
    old = disk.path(storage_name(digests[2], 0))
    st = os.stat(old)
    os.utime(old, ns=(st.st_atime_ns - 3600 * 10**9, st.st_mtime_ns - 3600 * 10**9))  # an hour earlier
    scanner = DirectoryScanner(str(tmp_path), 1)
    scanner.scan()
    scrub = DiskScrubber(disk, scanner.chunks, 1, 0.0, start=False)
    _damage(disk, digests[1])
    _damage(disk, digests[2])
    scrub.load_found_damaged(digests[0], others=[])
    while scrub.work() is not None:
        pass
    assert scrub.take_damaged() == [digests[1]]


def test_the_walk_leaves_fresh_records_to_the_loads(tmp_path):
    disk, digests, _ = _scrubber(tmp_path, n=2)
    _damage(disk, digests[0])
    scanner = DirectoryScanner(str(tmp_path), 1)
    scanner.scan()
    walk = DiskScrubber(disk, scanner.chunks, 1, 1e6, start=False)  # records younger than 10 min
    assert walk.work() is None and walk.take_damaged() == []


def test_the_walk_verifies_every_record_in_turn_and_only_when_on(tmp_path):
    disk, digests, off = _scrubber(tmp_path, n=4, rate=0.0)
    _damage(disk, digests[3])
    assert off.work() is None and off.scrubbed_records == 0
    scanner = DirectoryScanner(str(tmp_path), 1)
    scanner.scan()
    on = DiskScrubber(disk, scanner.chunks, 1, 1e6, start=False, min_age_s=0)
    read = [on.work() for _ in range(4)]
    assert all(n > 4096 for n in read) and on.scrubbed_records == 4
    assert on.take_damaged() == [digests[3]]
    assert on.work() is not None  # the next pass starts over


def test_the_thread_finds_suspects_at_once_and_stops(tmp_path):
    disk, digests, _ = _scrubber(tmp_path, n=3)
    scanner = DirectoryScanner(str(tmp_path), 1)
    scanner.scan()
    scrub = DiskScrubber(disk, scanner.chunks, 1, 0.0)  # the walk off: only suspects
    _damage(disk, digests[1])
    scrub.load_found_damaged(digests[0], others=[digests[2]])
    deadline = time.monotonic() + 10.0
    while not scrub.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scrub.take_damaged() == [digests[1]]
    scrub.stop()
    assert scrub._thread is not None and not scrub._thread.is_alive()


def test_a_damaged_load_makes_the_scheduler_forget_other_damaged_chunks_written_with_it(tmp_path):
    """Another prompt's chunks, stored with the damaged one and damaged in the same way, leave
    the index before any load of them fails (on the old code, its lookup offered them and its
    load failed the next round)."""
    from connector.config.loading import load_config
    from connector.engine.jobs import DISK
    from connector.engine.outcomes import WorkerReport
    from connector.scheduler.connector_scheduler import ConnectorScheduler

    from .fakes import admit_fully, blocks, facts, request
    from .test_scheduler import PROMPT, loaded

    config = load_config(
        {
            "lmcache.local_cpu": False,
            "lmcache.local_disk": str(tmp_path),
            "lmcache.max_local_disk_size": 1,
            "lmcache.enable_async_loading": False,
            "lmcache.extra_config": {"disk_scrub_bytes_per_s": 0},  # no walk: the load's find alone
        },
        env={},
    )
    s = ConnectorScheduler(config, facts())
    other = list(range(7000, 7600))
    stored = []
    for rid, prompt in (("a", PROMPT), ("c", other)):
        _, plan = admit_fully(s, request(rid, prompt), blocks(0 if rid == "a" else 10, 5))
        s.finish(request(rid, prompt))
        stored += [job.name for job in plan.stores]
    disk = DiskTier(str(tmp_path), facts().kv_layout)
    _store(disk, stored)
    view = s.state.disk_view  # no rescan need have listed them: this engine stored them together
    deadline = time.monotonic() + 10.0
    for name in stored:
        _damage(disk, name)
    _, plan = admit_fully(s, request("b", PROMPT), blocks(20, 5))
    (job,) = plan.loads
    s.on_worker_report(WorkerReport(loads={"b": loaded(job, fail_at=0)}))
    while view.scrub.damaged_found < len(stored) - 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # the scrub's thread verifies the suspects
    assert s.lookup(request("d", other), 0) == 0  # c's damaged chunks were forgotten
    assert all(name not in s.tiers[DISK] for name in stored)
    sizes = s.sizes()  # exported as vllm:kvlens_disk_scrub_damaged_total and ..._records_total
    assert sizes.disk_scrub_damaged == len(stored) - 1 and sizes.disk_scrubbed_records >= len(stored) - 1
    s.shutdown()
