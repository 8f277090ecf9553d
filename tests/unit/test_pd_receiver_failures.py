"""PD receiver failures: a prefiller killed or gone silent mid-transfer, entries nobody claims, a
resend of claimed keys, two senders at once, close() during a transfer: none hangs, none leaks
(slots, entries, threads and sockets back to where they were), none hands out wrong bytes."""

from __future__ import annotations

import os
import socket
import textwrap
import threading

import pytest

from connector.pd import wire
from connector.pd.receive_buffer import attach
from connector.pd.receiver import PDReceiver
from connector.pd.sender import PDSender

from .pd_wire_support import (
    RawPeer,
    assert_idle,
    identity,
    kill,
    open_fds,
    pd_threads,
    receiver,
    records,
    send,
    spawn,
    wait_until,
)

# A prefiller rank that shakes hands, allocates two chunks, sends half of the first, says
# "ready" and hangs until it is killed.
HALF_SENDER = textwrap.dedent(
    """
    import socket, sys, time
    from connector.pd import wire
    from connector.pd.identity import PeerIdentity
    from connector.pd.probe import shake_hands
    ident = PeerIdentity("ks-0123abcd", 1, 0, 16, 256, "bf16/l4/kvh2/hd64/v1")
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    d = wire.Deadline(30)
    assert shake_hands(s, ident, 30).reply["ok"]
    alloc = {"req_id": "killed", "keys": ["a", "b"], "lengths": [65536, 65536], "tokens": [256, 256]}
    s.sendall(wire.control_frame(wire.FrameType.ALLOC, alloc))
    wire.recv_frame(s, d, 30)
    s.sendall(wire.chunk_header(0, 65536) + bytes(30000))
    print("ready", flush=True)
    time.sleep(600)
    """
)


def _read(claim, rank: int = 0) -> list[bytes]:  # type: ignore[no-untyped-def]
    worker = attach(claim.locations[0][rank].buffer_name)
    try:
        return [bytes(worker.view(loc[rank].offset, loc[rank].length)) for loc in claim.locations]
    finally:
        worker.close()


def test_a_prefiller_killed_mid_transfer_frees_its_slots_at_once():
    with receiver(transfer_timeout_s=60.0) as rx:
        child = spawn(HALF_SENDER, str(rx.init_ports[0]))
        try:
            assert rx.stats().in_flight == 1 and rx.stats().used_bytes == 2 * 65536
            kill(child)
        finally:
            if child.poll() is None:
                kill(child)
        wait_until(lambda: rx.stats().in_flight == 0, timeout=30.0, what="the partial transfer freed")
        assert rx.stats().failed == {"peer_closed": 1}
        assert rx.take_finished()[0].reason == "peer_closed"
        assert_idle(rx)


def test_a_prefiller_silent_mid_transfer_is_dropped_after_the_transfer_timeout():
    with receiver(transfer_timeout_s=0.3) as rx:
        peer = RawPeer(rx.init_ports[0])
        try:
            assert peer.hello()["ok"] and peer.alloc([65536, 65536])["ok"]
            peer.send(wire.chunk_header(0, 65536)[:5])  # not even a whole chunk header
            assert rx.stats().in_flight == 1
            assert peer.closed_by_peer()
        finally:
            peer.close()
        wait_until(lambda: rx.stats().in_flight == 0, what="the silent transfer freed")
        assert rx.stats().failed == {"timeout": 1}
        assert_idle(rx)


def test_unclaimed_entries_expire_and_claimed_ones_do_not():
    now = [1000.0]
    with receiver(unclaimed_timeout_s=60.0, clock=lambda: now[0]) as rx:
        tx = PDSender(identity(), 2.0, 5.0)
        try:
            assert send(tx, rx.init_ports[0], records(2, 4096, 10), req_id="kept").ok
            assert send(tx, rx.init_ports[0], records(2, 4096, 10), req_id="forgotten").ok
        finally:
            tx.close()
        claim = rx.claim(["kept-k0", "kept-k1"], "decode")
        now[0] += 59.0
        assert rx.expire() == 0
        now[0] += 2.0
        assert rx.expire() == 2  # the two entries of "forgotten"
        assert rx.present(["forgotten-k0"]) == 0 and rx.present(["kept-k0", "kept-k1"]) == 2
        assert _read(claim)[0] == records(2, 4096, 10)[0]
        now[0] += 1000.0
        assert rx.expire() == 0
        rx.release("decode")
        s = rx.stats()
        assert (s.expired, s.released) == (2, 2)
        assert_idle(rx)


def test_a_claims_slots_are_not_reused_before_release():
    data = records(2, 32 * 1024, 32 * 1024)
    with receiver(buffer_bytes=64 * 1024) as rx:
        tx = PDSender(identity(), 2.0, 5.0)
        try:
            assert send(tx, rx.init_ports[0], data, req_id="a").ok
            claim = rx.claim(["a-k0", "a-k1"], "decode")
            assert rx.expire() == 0
            outcome = send(tx, rx.init_ports[0], records(1, 1024, 1024, seed=9), req_id="b")
            assert outcome.reason == "buffer_full"
            assert _read(claim) == data
            rx.release("decode")
            assert send(tx, rx.init_ports[0], records(2, 32 * 1024, 32 * 1024, seed=3), req_id="c").ok
        finally:
            tx.close()


def test_a_resend_of_claimed_keys_does_not_touch_the_claimed_bytes():
    keys = ["k0", "k1", "k2"]
    first, second = records(3, 8192, 100, seed=1), records(3, 8192, 100, seed=2)
    with receiver() as rx:
        tx = PDSender(identity(), 2.0, 5.0)
        try:
            assert send(tx, rx.init_ports[0], first, keys=keys, req_id="first").ok
            used = rx.stats().used_bytes
            claim = rx.claim(keys, "decode")
            assert send(tx, rx.init_ports[0], second, keys=keys, req_id="resend").ok
            assert _read(claim) == first
            assert rx.stats().used_bytes == used and rx.stats().duplicates == 3
            again = rx.claim(keys, "decode-2")
            assert again.locations == claim.locations and _read(again) == first
            rx.release("decode")
            assert _read(again) == first  # still pinned by the second claim
            rx.release("decode-2")
        finally:
            tx.close()
        assert_idle(rx)


def test_two_senders_at_once_each_get_their_own_bytes():
    rounds = 8
    sent: dict[str, list[bytes]] = {}
    with receiver(buffer_bytes=16 << 20) as rx:

        def run(who: int) -> None:
            tx = PDSender(identity(), 2.0, 10.0)
            try:
                for i in range(rounds):
                    data = records(3, 64 * 1024, 1000 + i, seed=who * 100 + i)
                    req = f"s{who}-{i}"
                    sent[req] = data
                    assert send(tx, rx.init_ports[0], data, req_id=req).ok
            finally:
                tx.close()

        threads = [threading.Thread(target=run, args=(w,)) for w in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(sent) == 2 * rounds and rx.stats().transfers == {"ok": 2 * rounds}
        for req, data in sent.items():
            claim = rx.claim([f"{req}-k{i}" for i in range(3)], f"d-{req}")
            assert claim.req_id == req and _read(claim) == data
            rx.release(f"d-{req}")
        assert_idle(rx)


def test_close_during_a_transfer_returns_in_bounded_time_and_leaves_nothing():
    fds, threads = open_fds(), pd_threads()
    rx_cm = receiver(transfer_timeout_s=60.0)
    rx = rx_cm.__enter__()
    peer = RawPeer(rx.init_ports[0])
    try:
        assert peer.hello()["ok"] and peer.alloc([65536])["ok"]
        peer.send(wire.chunk_header(0, 65536), b"\x01" * 100)
        assert rx.stats().in_flight == 1
        rx_cm.__exit__(None, None, None)  # rx.close(), bounded by its 5 s
        assert peer.closed_by_peer()
    finally:
        peer.close()
    s = rx.stats()
    assert (s.used_bytes, s.entries, s.in_flight, s.connections) == (0, 0, 0, 0)
    assert s.failed == {"shutdown": 1}
    assert pd_threads() == threads
    assert open_fds() == fds


def test_entries_nobody_asks_about_expire_on_their_own_even_with_a_rank_missing():
    now = [0.0]
    with receiver(tp=2, unclaimed_timeout_s=5.0, clock=lambda: now[0], housekeeping_s=0.02) as rx:
        tx = PDSender(identity(0, tp=2), 2.0, 5.0)
        try:
            assert send(tx, rx.init_ports[0], records(2, 4096, 10)).ok  # rank 1 never sends
        finally:
            tx.close()
        assert rx.present(["proxy-1-k0"]) == 0 and rx.stats().entries == 2
        now[0] += 4.0
        assert rx.stats().entries == 2
        now[0] += 2.0
        wait_until(lambda: rx.stats().entries == 0, what="expiry without a call to expire()")
        assert rx.stats().expired == 2
        assert_idle(rx)


def test_a_port_in_use_fails_start_and_leaves_no_buffer_behind():
    from connector.pd.receive_buffer import buffer_dir

    before = set(buffer_dir().glob(f"kvlens-pd-{os.getpid()}-*"))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        rx = PDReceiver([identity()], "127.0.0.1", [0], [taken.getsockname()[1]], 1 << 20, 5.0, 60.0)
        with pytest.raises(OSError):
            rx.start()
        rx.close()
    assert set(buffer_dir().glob(f"kvlens-pd-{os.getpid()}-*")) == before
    assert "kvlens-pd-accept" not in pd_threads()


def test_a_buffer_left_by_a_dead_owner_is_removed_at_the_next_start():
    import fcntl
    import subprocess
    import sys

    from connector.pd.receive_buffer import buffer_dir

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = buffer_dir() / f"kvlens-pd-{dead.pid}-r0-0123456789ab"
    alive = buffer_dir() / f"kvlens-pd-{os.getppid()}-r0-0123456789ab"
    stale.write_bytes(b"x" * 4096)
    alive.write_bytes(b"x")
    held = os.open(alive, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # what a running owner holds for its buffer's whole life
    try:
        with receiver():
            assert not stale.exists()
            assert alive.exists()  # its owner still holds it
    finally:
        os.close(held)
        stale.unlink(missing_ok=True)
        alive.unlink(missing_ok=True)
