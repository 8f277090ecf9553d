import threading

import pytest

from connector.tiers.background import BackgroundWrites
from connector.tiers.base import ChunkMissing
from connector.tiers.cpu import CpuTier


class SlowTier(CpuTier):
    """A tier whose writes wait for the test to release them, or fail on request."""

    name = "disk"

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.fail = False

    def put(self, name, payload):
        self.release.wait(10)
        if self.fail:
            raise OSError(28, "No space left on device")
        return super().put(name, payload)


def test_put_returns_before_the_write_and_get_waits_for_it():
    inner = SlowTier()
    tier = BackgroundWrites(inner)
    tier.put("a", memoryview(b"x" * 8))
    assert tier.pending == 1
    with pytest.raises(ChunkMissing):
        inner.get("a")  # not written yet
    threading.Timer(0.05, inner.release.set).start()
    assert bytes(tier.get("a")) == b"x" * 8  # waited for the queued write
    tier.close()
    assert tier.pending == 0


def test_delete_never_overtakes_the_write_it_follows():
    inner = SlowTier()
    tier = BackgroundWrites(inner)
    tier.put("a", memoryview(b"x"))
    tier.delete("a")
    inner.release.set()
    tier.flush()
    with pytest.raises(ChunkMissing):
        tier.get("a")
    tier.close()


def test_failed_writes_are_collected_once_for_the_report():
    inner = SlowTier()
    inner.fail = True
    inner.release.set()
    tier = BackgroundWrites(inner)
    tier.put("a.r0", memoryview(b"x"))
    tier.flush()
    (failure,) = tier.take_failures()
    assert failure[0] == "a.r0" and "No space" in failure[1]
    assert tier.take_failures() == []
    tier.close()


def test_queue_is_bounded():
    inner = SlowTier()
    tier = BackgroundWrites(inner, max_pending=2)
    threading.Timer(0.1, inner.release.set).start()
    for i in range(5):  # blocks until earlier writes drain instead of holding every payload
        tier.put(str(i), memoryview(b"x"))
    assert len(tier._queued) <= 2
    tier.close()
    assert all(bytes(inner.get(str(i))) == b"x" for i in range(5))
