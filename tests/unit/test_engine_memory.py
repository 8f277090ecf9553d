"""The test suite's memory gate before an engine start (tests/engine_memory.py)."""

from tests.engine_memory import available_gb, wait_for_room


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_it_waits_until_the_machine_has_room_for_an_engine():
    clock = Clock()
    free = iter([1.0, 2.0, 3.0, 5.0])
    waited = wait_for_room(3.5, 300, read=lambda: next(free), sleep=clock.sleep, clock=clock)
    assert waited == 3.0


def test_the_wait_is_bounded_and_a_machine_that_cannot_say_never_waits():
    clock = Clock()
    assert wait_for_room(3.5, 10, read=lambda: 0.5, sleep=clock.sleep, clock=clock) == 10.0
    assert wait_for_room(3.5, 10, read=lambda: None, sleep=clock.sleep, clock=Clock()) == 0.0


def test_available_memory_is_read_from_meminfo(tmp_path):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       24683744 kB\nMemFree:         1000 kB\nMemAvailable:   4194304 kB\n")
    assert available_gb(str(info)) == 4.0
    assert available_gb(str(tmp_path / "missing")) is None
