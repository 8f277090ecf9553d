"""A slow tier behind BackgroundTier: ordered writes, bounded waits, dropped stores, no hangs."""

import threading
import time

import pytest

from connector.engine.health import TierHealth
from connector.engine.outcomes import FailureReason, TierState
from connector.tiers.background import BackgroundTier, QueueFull
from connector.tiers.base import ChunkMissing
from connector.tiers.cpu import CpuTier


class SlowTier(CpuTier):
    """A tier whose writes and reads wait for the test to release them, or fail on request."""

    name = "disk"

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.reads = threading.Event()
        self.reads.set()
        self.fail = False

    def put(self, name, payload):
        self.release.wait(30)
        if self.fail:
            raise OSError(28, "No space left on device")
        return super().put(name, payload)

    def get(self, name):
        self.reads.wait(30)
        return super().get(name)


def background(inner, **kw) -> BackgroundTier:
    return BackgroundTier(inner, TierHealth(inner.name), **kw)


def test_put_returns_before_the_write_and_get_waits_for_it():
    inner = SlowTier()
    tier = background(inner)
    tier.put("a", memoryview(b"x" * 8))
    assert tier.pending == 1
    with pytest.raises(ChunkMissing):
        CpuTier.get(inner, "a")  # not written yet
    threading.Timer(0.05, inner.release.set).start()
    assert bytes(tier.get("a")) == b"x" * 8  # waited for the queued write
    tier.close()
    assert tier.pending == 0


def test_delete_never_overtakes_the_write_it_follows():
    inner = SlowTier()
    tier = background(inner)
    tier.put("a", memoryview(b"x"))
    tier.delete("a")
    inner.release.set()
    assert tier.drain(5)
    with pytest.raises(ChunkMissing):
        tier.get("a")
    tier.close()


def test_failed_writes_are_collected_once_with_their_reason_and_mark_the_tier():
    inner = SlowTier()
    inner.fail = True
    inner.release.set()
    tier = background(inner)
    for i in range(3):
        tier.put(f"a{i}.r0", memoryview(b"x"))
    assert tier.drain(5)
    failures = tier.take_failures()
    assert [(n, r) for n, r, _ in failures] == [(f"a{i}.r0", FailureReason.IO_ERROR) for i in range(3)]
    assert "No space" in failures[0][2]
    assert tier.take_failures() == []
    assert tier.health.state is TierState.SKIPPED  # three in a row: stop using it
    tier.close()


def test_a_write_that_does_not_fit_the_queue_is_refused_at_once():
    inner = SlowTier()
    tier = background(inner, max_pending_bytes=10)
    tier.put("a", memoryview(b"x" * 6))
    started = time.monotonic()
    with pytest.raises(QueueFull):
        tier.put("b", memoryview(b"x" * 6))  # never waits for the stuck write
    assert time.monotonic() - started < 0.5
    tier.delete("c")  # deletes hold no payload: always queued
    inner.release.set()
    tier.close()
    assert bytes(inner.get("a")) == b"x" * 6


def test_a_read_of_a_stuck_tier_times_out_and_a_stuck_write_is_noticed():
    inner = SlowTier()
    inner.reads.clear()
    tier = background(inner, timeout_s=0.2)
    started = time.monotonic()
    (result,) = tier.get_many(["nothing"])
    assert isinstance(result, TimeoutError) and time.monotonic() - started < 1.0
    tier.put("a", memoryview(b"x"))
    time.sleep(0.3)
    assert tier.stuck()
    inner.reads.set()
    inner.release.set()
    tier.close()


def test_reads_of_many_chunks_start_together_and_come_back_in_order():
    inner = SlowTier()
    inner.release.set()
    tier = background(inner)
    for name in "abc":
        tier.put(name, memoryview(name.encode()))
    results = list(tier.get_many(["a", "missing", "c"]))
    assert bytes(results[0]) == b"a" and isinstance(results[1], ChunkMissing) and bytes(results[2]) == b"c"
    tier.close()


def test_close_gives_up_on_a_hung_tier_within_its_timeout():
    inner = SlowTier()  # never released
    tier = background(inner)
    tier.put("a", memoryview(b"x"))
    started = time.monotonic()
    assert tier.close(timeout_s=0.3) is False
    assert time.monotonic() - started < 2.0
    inner.release.set()
