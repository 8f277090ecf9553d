"""The receive index: the scheduler never waits for a receiver, a resend does not keep a record
alive, and a record's slot is freed once and never while claimed (issue 36, items 4 and 6)."""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from connector.pd.receive_buffer import ReceiveBuffer, Slot
from connector.pd.receive_index import Claim, ReceiveIndex, TransferFacts

HOLES = 20_000
BOUND_S = 0.010  # the old index waited out the receiver's allocation: about 2 s here


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@contextmanager
def buffers(tp: int = 1, capacity: int = 1 << 20) -> Iterator[list[ReceiveBuffer]]:
    made = [ReceiveBuffer(capacity, r) for r in range(tp)]
    try:
        yield made
    finally:
        for b in made:
            b.close()


def send(index: ReceiveIndex, buffer: ReceiveBuffer, rank: int, keys: list[str], at: float) -> None:
    """What the receiver does with a verified transfer: slots, then one ``add``."""
    slots = buffer.allocate_all([4096] * len(keys))
    assert slots is not None
    index.add(rank, keys, [16] * len(keys), slots, TransferFacts("req", 4096 * len(keys), 1.0, at))


@contextmanager
def receiver_allocating(buffer: ReceiveBuffer) -> Iterator[threading.Event]:
    """A receiver thread inside ``allocate_all``, holding the buffer's lock until the event is set."""
    allocator = buffer._allocator
    entered, leave = threading.Event(), threading.Event()
    real = allocator.allocate_all

    def slow(lengths):  # type: ignore[no-untyped-def]
        entered.set()
        leave.wait(30)
        return real(lengths)

    allocator.allocate_all = slow  # type: ignore[method-assign]
    thread = threading.Thread(target=buffer.allocate_all, args=([64],))
    thread.start()
    try:
        assert entered.wait(5)
        yield leave
    finally:
        leave.set()
        thread.join()
        allocator.allocate_all = real  # type: ignore[method-assign]


def in_thread(run, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    """Whether ``run`` returned within ``timeout`` (it may still finish later)."""
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    return not thread.is_alive()


def test_a_resent_key_does_not_restart_its_expiry(clock):
    with buffers() as (buffer,):
        index = ReceiveIndex([buffer], 5.0, clock)
        send(index, buffer, 0, ["k"], at=0.0)
        send(index, buffer, 0, ["k"], at=4.0)  # the resend's slot is freed, the record stays
        assert index.duplicates == 1 and buffer.used_bytes == 4096
        clock.now = 4.9
        assert index.expire() == 0
        clock.now = 5.0
        assert index.expire() == 1 and buffer.used_bytes == 0


def test_a_key_waits_its_timeout_once_from_when_every_rank_has_it(clock):
    with buffers(tp=2) as (r0, r1):
        index = ReceiveIndex([r0, r1], 5.0, clock)
        send(index, r0, 0, ["k"], at=0.0)
        send(index, r1, 1, ["k"], at=4.0)  # whole now: a decoder request can use it from here
        send(index, r0, 0, ["k"], at=8.0)  # a resend to a rank that has it moves nothing
        send(index, r1, 1, ["k"], at=8.5)
        clock.now = 8.9
        assert index.expire() == 0 and index.present(["k"]) == 1
        clock.now = 9.0
        assert index.expire() == 1 and r0.used_bytes == r1.used_bytes == 0


def test_a_key_that_never_becomes_whole_expires_after_its_first_arrival(clock):
    with buffers(tp=2) as (r0, r1):
        index = ReceiveIndex([r0, r1], 5.0, clock)
        send(index, r0, 0, ["k"], at=0.0)
        send(index, r0, 0, ["k"], at=3.0)
        clock.now = 5.0
        assert index.expire() == 1 and r0.used_bytes == 0


def test_release_returns_while_a_receiver_holds_the_buffer_and_the_slots_come_back_after(clock):
    with buffers() as (buffer,):
        index = ReceiveIndex([buffer], 5.0, clock)
        send(index, buffer, 0, ["a", "b"], at=0.0)
        assert index.claim(["a", "b"], "d1") is not None
        with receiver_allocating(buffer):
            assert in_thread(lambda: index.release("d1"), timeout=2.0), "release waited for the buffer"
            assert index.counts() == (0, 0) and index.present(["a"]) == 0
        assert buffer.used_bytes == 64  # the receiver's own slot; the two records are free again


def test_expire_returns_while_a_receiver_holds_the_buffer(clock):
    with buffers() as (buffer,):
        index = ReceiveIndex([buffer], 5.0, clock)
        send(index, buffer, 0, ["a"], at=0.0)
        clock.now = 10.0
        with receiver_allocating(buffer):
            assert in_thread(index.expire, timeout=2.0), "expire waited for the buffer"
            assert index.expired == 1
        assert buffer.used_bytes == 64


def test_a_claimed_record_keeps_its_slot_until_release(clock):
    with buffers(capacity=2 * 4096) as (buffer,):
        index = ReceiveIndex([buffer], 5.0, clock)
        send(index, buffer, 0, ["a", "b"], at=0.0)
        claim = index.claim(["a"], "d1")
        clock.now = 100.0
        assert index.expire() == 1  # "b" only
        assert buffer.allocate_all([4096, 4096]) is None  # "a"'s slot is not handed out
        assert claim is not None and buffer.allocate_all([4096]) == [Slot(4096, 4096)]
        index.release("d1")
        assert buffer.allocate_all([4096]) == [Slot(claim.locations[0][0].offset, 4096)]


def test_a_transfer_whose_keys_and_slots_disagree_indexes_nothing(clock):
    with buffers() as (buffer,):
        index = ReceiveIndex([buffer], 5.0, clock)
        slots = buffer.allocate_all([4096])
        with pytest.raises(ValueError):
            index.add(0, ["a", "b"], [16, 16], slots, TransferFacts("req", 4096, 1.0, 0.0))
        assert index.counts() == (0, 0) and buffer.used_bytes == 4096  # the receiver frees them


def test_under_concurrent_arrivals_claims_and_expiry_a_claimed_record_never_changes(clock, caplog):
    """Receivers stamp every slot they fill; a claimed record's stamp must hold until release."""
    stamps = itertools.count(1)
    with buffers(tp=2, capacity=64 * 4096) as pair:
        index = ReceiveIndex(pair, 0.01, clock)
        stop = threading.Event()
        seen = {"claims": 0, "checked": 0}

        def receiver(rank: int) -> None:
            i = 0
            while not stop.is_set():
                keys = [f"k{(i + j) % 40}" for j in range(4)]
                slots = pair[rank].allocate_all([4096] * 4)
                if slots is not None:
                    for slot in slots:
                        pair[rank].writable(slot)[:8] = next(stamps).to_bytes(8, "little")
                    index.add(rank, keys, [16] * 4, slots, TransferFacts("r", 1, 1.0, clock()))
                i += 1

        def stamped(claim: Claim) -> list[bytes]:
            return [
                bytes(pair[r].writable(Slot(loc.offset, 8)))
                for locs in claim.locations
                for r, loc in enumerate(locs)
            ]

        def scheduler() -> None:
            held: dict[str, tuple[Claim, list[bytes]]] = {}
            for i in itertools.count():
                if stop.is_set():
                    break
                claim = index.claim([f"k{i % 40}", f"k{(i + 1) % 40}"], f"d{i}")
                if claim is not None:
                    held[claim.request_id] = (claim, stamped(claim))
                    seen["claims"] += 1
                clock.now += 0.001
                index.expire()
                old = held.pop(f"d{i - 3}", None)
                if old is not None:
                    seen["checked"] += 1
                    if stamped(old[0]) != old[1]:
                        seen["refilled"] = seen.get("refilled", 0) + 1
                index.release(f"d{i - 3}")

        threads = [
            threading.Thread(target=f, args=a)
            for f, a in ((receiver, (0,)), (receiver, (1,)), (scheduler, ()))
        ]
        for t in threads:
            t.start()
        time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join()
        assert "refilled" not in seen, f"claimed records' slots were filled again: {seen}"
        assert seen["checked"] > 10 and index.expired > 10 and index.duplicates > 10, (seen, index.expired)
        index.drop_all()
        assert [b.used_bytes for b in pair] == [0, 0]
        assert [b.allocate_all([64 * 4096]) is not None for b in pair] == [True, True]
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


def fragmented_index(buffer: ReceiveBuffer, clock: Clock, holes: int = HOLES) -> ReceiveIndex:
    """``holes`` records, each with a hole beside it: every key arrived twice in one transfer."""
    index = ReceiveIndex([buffer], 5.0, clock)
    slots = buffer.allocate_all([64] * (2 * holes))
    assert slots is not None
    for b in range(holes // 100):  # a transfer a second, 100 keys each sent twice
        keys = [f"k{i}" for i in range(b * 100, (b + 1) * 100) for _ in (0, 1)]
        index.add(0, keys, [16] * 200, slots[b * 200 : (b + 1) * 200], TransferFacts("r", 1, 1.0, float(b)))
    assert index.duplicates == holes
    return index


def while_a_transfer_is_placed(buffer: ReceiveBuffer, run) -> float:  # type: ignore[no-untyped-def]
    """Seconds ``run`` takes while a receiver places a 2,000-chunk transfer (none fits a hole)."""
    placed: list[list[Slot] | None] = []
    thread = threading.Thread(target=lambda: placed.append(buffer.allocate_all([128] * 2000)))
    thread.start()
    while not buffer._lock.locked() and thread.is_alive():
        time.sleep(0)
    start = time.perf_counter()
    run()
    took = time.perf_counter() - start
    thread.join()
    for slot in placed[0] or []:
        buffer.free(slot)
    return took


def test_release_and_expire_among_20000_holes_do_not_wait_for_a_transfer_being_placed(clock):
    with buffers(capacity=64 * 2 * HOLES + (1 << 20)) as (buffer,):
        index = fragmented_index(buffer, clock)
        released, expired = [], []
        for i in range(5):
            assert index.claim([f"k{j}" for j in range(i * 100, (i + 1) * 100)], f"d{i}") is not None
            released.append(while_a_transfer_is_placed(buffer, lambda i=i: index.release(f"d{i}")))
        for i in range(5):
            clock.now = 10.0 + i  # a transfer's 100 records are due each time (5 + i, held 5 s)
            expired.append(while_a_transfer_is_placed(buffer, index.expire))
        assert statistics.median(released) < BOUND_S, (
            f"release took {statistics.median(released) * 1000:.1f} ms"
        )
        assert statistics.median(expired) < BOUND_S, f"expire took {statistics.median(expired) * 1000:.1f} ms"
        assert index.released == 500 and index.expired == 500


def test_expire_with_nothing_due_costs_the_same_for_200_records_as_for_20000(clock):
    def idle_expire_seconds(holes: int) -> float:
        with buffers(capacity=64 * 2 * holes) as (buffer,):
            index = fragmented_index(buffer, clock, holes)
            clock.now = 1.0  # nothing is due yet
            took = []
            for _ in range(21):
                start = time.perf_counter()
                assert index.expire() == 0
                took.append(time.perf_counter() - start)
            return statistics.median(took)

    few, many = idle_expire_seconds(200), idle_expire_seconds(HOLES)
    assert many < 5 * few + 50e-6, f"{few * 1e6:.0f} us for 200 records, {many * 1e6:.0f} us for 20,000"


def test_deadlines_of_released_entries_do_not_pile_up_under_a_long_timeout(clock):
    with buffers(capacity=64 * 64) as (buffer,):
        index = ReceiveIndex([buffer], 1e9, clock)
        for i in range(5000):
            slots = buffer.allocate_all([64])
            index.add(0, [f"k{i}"], [16], slots, TransferFacts("r", 64, 1.0, float(i)))
            assert index.claim([f"k{i}"], f"d{i}") is not None
            index.release(f"d{i}")
            clock.now = float(i)
            assert index.expire() == 0
        assert index.released == 5000 and buffer.used_bytes == 0
        assert len(index._deadlines) <= 1024 + 1  # what is held (nothing) and a bounded slack
