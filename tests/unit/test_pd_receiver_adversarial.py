"""PD receiver against bad input: lengths that would allocate without bound, unknown frames,
garbage handshakes, slow-loris connections and connection floods are refused within bounds,
counted, and cost no memory beyond the bound."""

from __future__ import annotations

import os
import struct
import threading
import time
import tracemalloc

import pytest

from connector.pd import wire
from connector.pd.sender import PDSender

from .pd_wire_support import RawPeer, assert_idle, identity, receiver, records, send, wait_until


def _refused(rx, peer: RawPeer, reason: str) -> None:  # type: ignore[no-untyped-def]
    assert peer.closed_by_peer(), "the receiver kept a connection that broke the protocol"
    peer.close()
    wait_until(lambda: rx.stats().connections == 0, what="the connection ended")
    assert rx.stats().failed == {reason: 1}
    assert_idle(rx)


@pytest.mark.parametrize(
    "head",
    [
        wire.HEADER.pack(wire.MAGIC, wire.FrameType.HELLO, 2**32 - 1),  # "a 4 GiB handshake"
        wire.HEADER.pack(wire.MAGIC, wire.FrameType.HELLO, wire.MAX_CONTROL_BYTES + 1),
        wire.HEADER.pack(wire.MAGIC, wire.FrameType.CHUNK, 2**31),
        wire.HEADER.pack(wire.MAGIC, 99, 8),  # an unknown frame type
        b"GET / HTTP/1.1\r\n\r\n",  # a handshake of garbage
        os.urandom(64),
    ],
    ids=["4GiB-hello", "hello-over-limit", "chunk-body-2^31", "unknown-type", "http", "random"],
)
def test_a_bad_first_frame_is_refused_without_allocating(head):
    with receiver() as rx:
        tracemalloc.start()
        try:
            peer = RawPeer(rx.init_ports[0])
            peer.send(head)
            _refused(rx, peer, "bad_frame")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize(
    "body",
    [
        {"identity": "me"},
        {"identity": {**identity().to_wire(), "tp_size": 2**40}},
        {"identity": {**identity().to_wire(), "record_layout": "x" * 100_000}},
    ],
)
def test_a_handshake_that_does_not_carry_an_identity_is_refused(body):
    with receiver() as rx:
        peer = RawPeer(rx.init_ports[0])
        nonce = os.urandom(32)
        peer.send(wire.control_frame(wire.FrameType.HELLO, {"version": wire.VERSION, "nonce": nonce}))
        assert set(peer.reply()) == {"version", "nonce", "proof"}  # nothing about the receiver yet
        peer.send(wire.control_frame(wire.FrameType.AUTH, {**body, "proof": None}))
        _refused(rx, peer, "bad_frame")


@pytest.mark.parametrize(
    "hello",
    [{}, {"version": "2"}, {"version": wire.VERSION}, {"version": wire.VERSION, "nonce": b"short"}],
)
def test_a_hello_without_a_version_or_a_nonce_is_refused(hello):
    with receiver() as rx:
        peer = RawPeer(rx.init_ports[0])
        peer.send(wire.control_frame(wire.FrameType.HELLO, hello))
        _refused(rx, peer, "bad_frame")


@pytest.mark.parametrize(
    "alloc",
    [
        {"req_id": "r", "keys": ["a"], "lengths": [2**60], "tokens": [1]},
        {"req_id": "r", "keys": ["a"], "lengths": [-1], "tokens": [1]},
        {"req_id": "r", "keys": ["a", "b"], "lengths": [1], "tokens": [1]},
        {"req_id": "r", "keys": ["a", "a"], "lengths": [1, 1], "tokens": [1, 1]},
        {"req_id": "r", "keys": [], "lengths": [], "tokens": []},
        {"req_id": "r", "keys": ["k" * 1000], "lengths": [1], "tokens": [1]},
        {"keys": ["a"]},
    ],
)
def test_a_malformed_allocation_is_refused(alloc):
    with receiver() as rx:
        peer = RawPeer(rx.init_ports[0])
        assert peer.hello()["ok"]
        peer.send(wire.control_frame(wire.FrameType.ALLOC, alloc))
        _refused(rx, peer, "bad_frame")


def test_an_allocation_over_the_control_limit_is_refused_by_its_header():
    with receiver() as rx:
        peer = RawPeer(rx.init_ports[0])
        assert peer.hello()["ok"]
        n = 60_000
        alloc = {
            "req_id": "r",
            "keys": [f"key-{i:020d}" for i in range(n)],
            "lengths": [1] * n,
            "tokens": [1] * n,
        }
        frame = wire.control_frame(wire.FrameType.ALLOC, alloc)
        assert len(frame) > wire.MAX_CONTROL_BYTES
        try:
            peer.send(frame)
        except OSError:
            pass  # the receiver may close before the whole frame is written
        _refused(rx, peer, "bad_frame")


def test_a_huge_allocation_that_is_well_formed_is_answered_too_large():
    with receiver() as rx:
        peer = RawPeer(rx.init_ports[0])
        assert peer.hello()["ok"]
        assert peer.alloc([2**39]) == {"ok": False, "reason": "too_large"}
        peer.close()
        assert_idle(rx)


@pytest.mark.parametrize(
    "chunk",
    [
        wire.chunk_header(0, 2**60),  # a chunk claiming 2^60 bytes
        wire.chunk_header(5, 1024),  # an index that was never allocated
        wire.chunk_header(0, 1023),  # a length other than the allocated one
        wire.control_frame(wire.FrameType.HELLO, {}),  # a frame that has no place in a transfer
        wire.control_frame(wire.FrameType.END, {}),  # the end before any chunk
    ],
    ids=["2^60", "index", "length", "hello", "early-end"],
)
def test_a_bad_frame_inside_a_transfer_frees_its_slots(chunk):
    with receiver() as rx:
        peer = RawPeer(rx.init_ports[0])
        assert peer.hello()["ok"] and peer.alloc([1024, 1024])["ok"]
        peer.send(chunk)
        _refused(rx, peer, "bad_frame")


def test_a_chunk_sent_twice_is_refused():
    with receiver() as rx:
        peer = RawPeer(rx.init_ports[0])
        assert peer.hello()["ok"] and peer.alloc([1024, 1024])["ok"]
        peer.chunk(0, bytes(1024))
        peer.chunk(0, bytes(1024))
        _refused(rx, peer, "bad_frame")


def _trickle(peer: RawPeer, data: bytes, stop: threading.Event) -> None:
    for b in data:
        if stop.wait(0.05):
            return
        try:
            peer.send(bytes([b]))
        except OSError:
            return


def test_a_slow_loris_handshake_is_cut_off_at_the_handshake_bound():
    with receiver(handshake_timeout_s=0.5) as rx:
        peer = RawPeer(rx.init_ports[0])
        body = {"version": wire.VERSION, "nonce": os.urandom(32)}
        hello = wire.control_frame(wire.FrameType.HELLO, body)
        stop = threading.Event()
        writer = threading.Thread(target=_trickle, args=(peer, hello * 10, stop))
        start = time.monotonic()
        writer.start()
        try:
            assert peer.closed_by_peer()
            assert time.monotonic() - start < 10.0  # a bound, far above the 0.5 s
        finally:
            stop.set()
            writer.join()
        _refused(rx, peer, "timeout")


def test_a_slow_loris_chunk_is_cut_off_and_its_slots_freed():
    with receiver(transfer_timeout_s=0.5) as rx:
        peer = RawPeer(rx.init_ports[0])
        assert peer.hello()["ok"] and peer.alloc([4096])["ok"]
        stop = threading.Event()
        writer = threading.Thread(
            target=_trickle, args=(peer, wire.chunk_header(0, 4096) + bytes(4096), stop)
        )
        writer.start()
        try:
            assert peer.closed_by_peer()
        finally:
            stop.set()
            writer.join()
        _refused(rx, peer, "timeout")


def test_a_full_table_closes_the_longest_idle_connection_for_a_new_one():
    with receiver(max_connections=2) as rx:
        held = []
        for _ in range(2):
            held.append(RawPeer(rx.init_ports[0]))
            assert held[-1].hello()["ok"]  # idle between transfers now
        tx = PDSender(identity(), 2.0, 5.0)
        try:
            assert send(tx, rx.init_ports[0], records(1, 100, 100)).ok
        finally:
            tx.close()
        assert held[0].closed_by_peer()  # the one idle the longest made room
        assert rx.stats().evicted == 1 and "too_many_connections" not in rx.stats().failed
        for p in held:
            p.close()


def test_a_peer_whose_handshake_was_answered_is_no_longer_counted_as_handshaking(monkeypatch):
    """The receiver answered the handshake, then marked the connection idle: on a busy machine a
    new connection came in that window, found the slots of unauthenticated peers full (the
    answered one still among them) and closed it (a full run: two connections evicted where
    one should be). A connection is marked authenticated before its peer hears so."""
    from connector.pd import receiver_conns

    real = receiver_conns.ConnectionTable.set_state

    def late(self, conn, state):  # the receiver's thread descheduled for a while
        if state == receiver_conns.IDLE:
            time.sleep(0.3)
        return real(self, conn, state)

    monkeypatch.setattr(receiver_conns.ConnectionTable, "set_state", late)
    with receiver(max_connections=2) as rx:
        first = RawPeer(rx.init_ports[0])
        assert first.hello()["ok"]
        second = RawPeer(rx.init_ports[0])  # the handshaking share is one slot of two
        assert second.hello()["ok"]
        assert rx.stats().evicted == 0 and not first.closed_by_peer(timeout=0.5)
        for p in (first, second):
            p.close()


def test_the_longest_idle_is_the_one_accepted_first_however_late_its_thread_runs(monkeypatch):
    """How long a connection has been idle counts from its handshake's end: its serving thread
    coming back late to wait for a transfer must not make it look newer (in a full run the
    first of two idle peers was kept and the second closed for a newcomer)."""
    from connector.pd import receiver_conns

    real = receiver_conns.ConnectionTable.set_state
    first_thread_back: list[object] = []

    def late(self, conn, state):  # the first connection's thread is descheduled after its reply
        if state == receiver_conns.IDLE and conn.state == receiver_conns.IDLE and not first_thread_back:
            first_thread_back.append(conn)
            time.sleep(0.5)
        return real(self, conn, state)

    monkeypatch.setattr(receiver_conns.ConnectionTable, "set_state", late)
    with receiver(max_connections=2) as rx:
        held = [RawPeer(rx.init_ports[0])]
        assert held[0].hello()["ok"]
        held.append(RawPeer(rx.init_ports[0]))
        assert held[1].hello()["ok"]
        time.sleep(0.7)  # the first thread is back
        tx = PDSender(identity(), 2.0, 5.0)
        try:
            assert send(tx, rx.init_ports[0], records(1, 100, 100)).ok
        finally:
            tx.close()
        assert held[0].closed_by_peer() and not held[1].closed_by_peer(timeout=0.5)
        for p in held:
            p.close()


def test_peers_that_never_finish_a_handshake_hold_at_most_half_the_slots():
    with receiver(max_connections=4, handshake_timeout_s=30.0) as rx:
        silent = [RawPeer(rx.init_ports[0]) for _ in range(6)]  # connect and say nothing
        wait_until(lambda: rx.stats().evicted == 4, what="the oldest silent ones closed")
        assert rx.stats().connections == 2 and silent[0].closed_by_peer()
        tx = PDSender(identity(), 2.0, 5.0)
        try:  # the operator's prefiller still gets through
            assert send(tx, rx.init_ports[0], records(1, 100, 100)).ok
        finally:
            tx.close()
            for p in silent:
                p.close()
        assert "too_many_connections" not in rx.stats().failed


def test_connections_beyond_the_limit_while_every_slot_is_busy_are_refused_and_counted():
    with receiver(max_connections=2) as rx:
        busy = []
        for _ in range(2):  # each in a transfer that has not ended
            busy.append(RawPeer(rx.init_ports[0]))
            assert busy[-1].hello()["ok"] and busy[-1].alloc([1024])["ok"]
        extra = RawPeer(rx.init_ports[0])
        assert extra.closed_by_peer()
        extra.close()
        assert rx.stats().failed == {"too_many_connections": 1} and rx.stats().evicted == 0
        for p in busy:
            p.close()


def test_the_header_limits_hold_for_every_frame_type():
    for kind in wire.FrameType:
        limit = wire.CHUNK_BODY.size if kind is wire.FrameType.CHUNK else wire.MAX_CONTROL_BYTES
        with pytest.raises(wire.WireError):
            wire.parse_header(struct.pack("<2sBxI", wire.MAGIC, kind, limit + 1))
        assert wire.parse_header(struct.pack("<2sBxI", wire.MAGIC, kind, limit)) == (kind, limit)
