"""PD back-pressure: a transfer gets all its slots or none, a full buffer answers at once, a
transfer bigger than the whole buffer is refused as too large, and the sender never retries."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.pd.receive_buffer import Slot, SlotAllocator
from connector.pd.sender import PDSender

from .pd_wire_support import RawPeer, assert_idle, identity, receiver, records, send, wait_until


def test_the_allocator_gives_all_slots_or_none_and_coalesces_on_free():
    a = SlotAllocator(1024)
    first = a.allocate_all([100, 200])
    assert first == [Slot(0, 100), Slot(128, 200)] and a.used == 128 + 256
    assert a.allocate_all([600, 100]) is None  # 640 + 128 > 640 left
    assert a.used == 384  # nothing kept from the refused request
    a.free(first[0])
    assert a.allocate_all([640]) == [Slot(384, 640)]
    assert a.allocate_all([64, 64]) == [Slot(0, 64), Slot(64, 64)]
    a.free(Slot(0, 64))
    with pytest.raises(ValueError, match="freed twice"):
        a.free(Slot(0, 64))
    a.free(Slot(64, 64))
    a.free(Slot(128, 200))
    a.free(Slot(384, 640))
    assert a.used == 0
    assert a.allocate_all([1024]) == [Slot(0, 1024)]  # the free extents merged back into one


def test_fragmented_space_that_cannot_hold_a_slot_refuses_the_whole_transfer():
    a = SlotAllocator(4 * 64)
    s = a.allocate_all([64, 64, 64, 64])
    a.free(s[0])
    a.free(s[2])
    assert a.allocate_all([128]) is None and a.used == 128  # 128 free, but not in one piece


def test_a_full_buffer_answers_buffer_full_at_once_and_the_sender_does_not_retry():
    with receiver(buffer_bytes=64 * 1024) as rx:
        tx = PDSender(identity(), 2.0, io_timeout_s=30.0)
        try:
            assert send(tx, rx.init_ports[0], records(3, 16 * 1024, 16 * 1024), req_id="fills").ok
            used = rx.stats().used_bytes
            outcome = send(tx, rx.init_ports[0], records(2, 16 * 1024, 16 * 1024, seed=1), req_id="late")
            assert not outcome.ok and outcome.reason == "buffer_full"
            assert outcome.seconds < 30.0  # answered, not timed out
            assert rx.stats().used_bytes == used  # nothing of the refused transfer held
            assert rx.stats().failed == {"buffer_full": 1}
            assert rx.stats().transfers == {"ok": 1, "failed": 1}  # one request, not a loop
            assert tx.stats().failed == {"buffer_full": 1}
            assert rx.present(["late-k0"]) == 0
            # the same connection serves the next transfer once there is room
            assert rx.expire() == 0
            claim = rx.claim([f"fills-k{i}" for i in range(3)], "d")
            rx.release(claim.request_id)
            assert send(tx, rx.init_ports[0], records(2, 16 * 1024, 100, seed=2), req_id="after").ok
            assert tx.stats().connections_opened == 1
        finally:
            tx.close()


def test_a_transfer_larger_than_the_whole_buffer_is_too_large():
    with receiver(buffer_bytes=32 * 1024) as rx:
        tx = PDSender(identity(), 2.0, 30.0)
        try:
            outcome = send(tx, rx.init_ports[0], records(3, 16 * 1024, 1))
        finally:
            tx.close()
        assert not outcome.ok and outcome.reason == "too_large"
        assert rx.stats().failed == {"too_large": 1}
        assert_idle(rx)


def test_slots_held_by_a_transfer_in_flight_count_against_the_next_one():
    with receiver(buffer_bytes=64 * 1024) as rx:
        a, b = RawPeer(rx.init_ports[0]), RawPeer(rx.init_ports[0])
        try:
            assert a.hello()["ok"] and b.hello()["ok"]
            assert a.alloc([40 * 1024], req_id="a")["ok"]
            assert rx.stats().in_flight == 1 and rx.stats().used_bytes == 40 * 1024
            assert b.alloc([16 * 1024, 16 * 1024], req_id="b") == {"ok": False, "reason": "buffer_full"}
            assert rx.stats().used_bytes == 40 * 1024
        finally:
            a.close()
            b.close()
        wait_until(lambda: rx.stats().in_flight == 0, what="the abandoned transfer freed")
        assert_idle(rx)


def test_a_transfer_whose_aligned_slots_exceed_the_buffer_is_too_large_not_forever_full():
    with receiver(buffer_bytes=4 * 64) as rx:  # four 64-byte slots
        peer = RawPeer(rx.init_ports[0])
        try:
            assert peer.hello()["ok"]
            assert peer.alloc([1] * 5) == {"ok": False, "reason": "too_large"}  # 5 bytes, 5 slots
            assert peer.alloc([1] * 4)["ok"]
        finally:
            peer.close()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(st.lists(st.integers(1, 300), min_size=1, max_size=4), st.integers(0, 50)), max_size=60
    )
)
def test_live_slots_never_overlap_and_the_books_balance(steps):
    """Any sequence of allocations (a list of lengths) and frees (an index into the live ones)."""
    a = SlotAllocator(2048)
    live: list[Slot] = []
    for step in steps:
        if isinstance(step, list):
            before = a.used
            got = a.allocate_all(step)
            if got is None:
                assert a.used == before  # all or nothing
            else:
                assert [s.length for s in got] == step
                live += got
        elif live:
            a.free(live.pop(step % len(live)))
        spans = sorted((s.offset, s.offset + max(64, -(-s.length // 64) * 64)) for s in live)
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))
        assert all(0 <= start and end <= 2048 for start, end in spans)
        assert a.used == sum(end - start for start, end in spans)
    for s in live:
        a.free(s)
    assert a.used == 0 and a.allocate_all([2048]) == [Slot(0, 2048)]
