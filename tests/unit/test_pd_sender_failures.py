"""PD sender failures: a decoder down, silent or killed mid-transfer ends the transfer with a
reason within the sender's bounds, and closing the sender ends what is under way and queued."""

from __future__ import annotations

import contextlib
import socket
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

from bench.lib.ports import free_port
from connector.pd import wire
from connector.pd.receive_buffer import ReceiveBuffer
from connector.pd.sender import PDSender

from .pd_wire_support import (
    HOST,
    Done,
    RawPeer,
    answer_handshake,
    assert_idle,
    identity,
    kill,
    open_fds,
    pd_threads,
    receiver,
    records,
    send,
    spawn,
    transfer,
    wait_until,
)

# A decoder rank that accepts one transfer, reads 1 MiB of it, says "ready" and then hangs
# until it is killed.
STALLING_RECEIVER = textwrap.dedent(
    """
    import socket, sys
    from connector.pd import wire
    from connector.pd.identity import PeerIdentity
    from tests.unit.pd_wire_support import answer_handshake
    ident = PeerIdentity("ks-0123abcd", 1, 0, 16, 256, "bf16/l4/kvh2/hd64/v1")
    srv = socket.create_server(("127.0.0.1", int(sys.argv[1])))
    print("listening", flush=True)
    conn, _ = srv.accept()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    d = wire.Deadline(30)
    answer_handshake(conn, ident)
    wire.recv_frame(conn, d, 30)
    conn.sendall(wire.control_frame(wire.FrameType.REPLY, {"ok": True, "reason": None}))
    wire.recv_into(conn, memoryview(bytearray(1 << 20)), d, 30)
    print("ready", flush=True)
    import time; time.sleep(600)
    """
)


def test_a_decoder_nobody_listens_for_is_unreachable():
    tx = PDSender(identity(), connect_timeout_s=2.0, io_timeout_s=5.0)
    try:
        outcome = send(tx, free_port(), records(2, 1024, 10))
    finally:
        tx.close()
    assert not outcome.ok and outcome.reason == "unreachable" and outcome.bytes == 0
    assert tx.stats().failed == {"unreachable": 1}


def test_a_decoder_that_accepts_but_never_answers_times_out_within_the_io_bound():
    with socket.create_server((HOST, 0)) as silent:  # the kernel accepts; nobody answers
        tx = PDSender(identity(), connect_timeout_s=2.0, io_timeout_s=0.5)
        try:
            outcome = send(tx, silent.getsockname()[1], records(2, 1024, 10))
        finally:
            tx.close()
    assert outcome.reason == "timeout"
    assert 0.5 <= outcome.seconds < 5.0


def test_a_decoder_killed_mid_transfer_ends_the_transfer_as_peer_closed():
    fds, threads = open_fds(), pd_threads()
    port = free_port()
    child = spawn(STALLING_RECEIVER, str(port), ready="listening")
    tx = PDSender(identity(), connect_timeout_s=5.0, io_timeout_s=20.0)
    t, done = transfer(port, records(2, 32 << 20, 1024))
    try:
        tx.send(t)
        assert child.stdout.readline().strip() == "ready"  # 1 MiB of 32 read: mid-transfer
        kill(child)
        outcome = done.wait()
    finally:
        tx.close()
        if child.poll() is None:
            kill(child)
    assert outcome.reason == "peer_closed"  # a killed process's socket is reset, not silent
    assert outcome.seconds < 20.0
    assert pd_threads() == threads and open_fds() == fds


def test_close_ends_the_transfer_under_way_and_the_queued_ones_as_shutdown():
    fds, threads = open_fds(), pd_threads()
    with socket.create_server((HOST, 0)) as srv:
        port = srv.getsockname()[1]
        tx = PDSender(identity(), connect_timeout_s=2.0, io_timeout_s=60.0)
        # a server that accepts and never reads: the sender blocks in its handshake's reply
        first, first_done = transfer(port, records(2, 32 << 20, 10), req_id="under-way")
        queued = [transfer(port, records(1, 10, 10), req_id=f"queued-{i}") for i in range(3)]
        tx.send(first)
        for t, _ in queued:
            tx.send(t)
        conn, _ = srv.accept()
        try:
            tx.close(timeout_s=10.0)
        finally:
            conn.close()
    assert first_done.wait().reason == "shutdown"
    assert [d.wait().reason for _, d in queued] == ["shutdown"] * 3
    assert first_done.wait().seconds < 60.0
    late, late_done = transfer(port, records(1, 10, 10), req_id="late")
    tx.send(late)
    assert late_done.wait().reason == "shutdown"
    s = tx.stats()
    assert (s.queued, s.in_flight) == (0, 0) and s.failed == {"shutdown": 5}
    assert pd_threads() == threads
    assert open_fds() == fds


def test_a_kept_connection_the_decoder_closed_is_replaced_not_failed():
    with receiver(idle_timeout_s=0.2) as rx:
        tx = PDSender(identity(), 2.0, 5.0)
        try:
            assert send(tx, rx.init_ports[0], records(1, 100, 100), req_id="a").ok
            wait_until(lambda: rx.stats().connections == 0, what="the idle connection closed")
            assert send(tx, rx.init_ports[0], records(1, 100, 100), req_id="b").ok
            assert tx.stats().connections_opened == 2
            assert send(tx, rx.init_ports[0], records(1, 100, 100), req_id="c").ok
            assert tx.stats().connections_opened == 2  # a live one is reused
        finally:
            tx.close()


def test_a_malformed_transfer_is_never_sent_and_ends_as_invalid():
    with receiver() as rx:
        tx = PDSender(identity(), 2.0, 5.0)
        try:
            port = rx.init_ports[0]
            twice = send(tx, port, records(2, 100, 100), keys=["same", "same"])
            empty = send(tx, port, [b"", b"x"])
            strided = transfer(port, [b"abcd"])[0]
            done = Done()
            tx.send(replace(strided, chunks=[("k", memoryview(b"abcdefgh")[::2], 1)], on_done=done))
            assert [twice.reason, empty.reason, done.wait().reason] == ["invalid"] * 3
            nothing = send(tx, port, [])
            assert nothing.ok and nothing.bytes == 0
            assert tx.stats().connections_opened == 0
        finally:
            tx.close()
        assert rx.stats().failed == {} and rx.stats().connections == 0


def test_a_failing_on_done_does_not_stop_the_sender():
    with receiver() as rx:
        tx = PDSender(identity(), 2.0, 5.0)
        try:
            t, _ = transfer(rx.init_ports[0], records(1, 100, 100), req_id="a")
            tx.send(replace(t, on_done=lambda outcome: 1 / 0))
            assert send(tx, rx.init_ports[0], records(1, 100, 100), req_id="b").ok
        finally:
            tx.close()


@contextlib.contextmanager
def unanswered_port() -> Iterator[int]:
    """A port whose listener never accepts and whose accept queue is full: SYNs go unanswered."""
    with socket.socket() as full, contextlib.ExitStack() as fillers:
        full.bind((HOST, 0))
        full.listen(0)
        port = full.getsockname()[1]
        for _ in range(8):
            s = fillers.enter_context(socket.socket())
            s.setblocking(False)
            s.connect_ex((HOST, port))
        yield port


def test_a_decoder_whose_accept_queue_is_full_is_unreachable_after_the_connect_timeout():
    with unanswered_port() as port:
        tx = PDSender(identity(), connect_timeout_s=0.5, io_timeout_s=5.0)
        try:
            outcome = send(tx, port, records(1, 100, 100))
        finally:
            tx.close()
    assert outcome.reason in ("unreachable", "timeout")
    assert outcome.seconds < 5.0  # bounded by the connect timeout (or the handshake's read)


def test_stats_carry_what_the_metrics_need():
    with receiver(buffer_bytes=64 * 1024) as rx:
        tx = PDSender(identity(), 2.0, 5.0)
        try:
            data = records(3, 8192, 100)
            assert send(tx, rx.init_ports[0], data, req_id="a").ok
            assert send(tx, rx.init_ports[0], records(1, 1, 60 * 1024), req_id="b").reason == "buffer_full"
            assert send(tx, free_port(), records(1, 10, 10), req_id="c").reason == "unreachable"
        finally:
            tx.close()
        sent = tx.stats()
        assert sent.sent_bytes == sum(map(len, data)) and sent.send_seconds > 0
        assert sent.transfers == {"ok": 1, "failed": 2}
        assert sent.failed == {"buffer_full": 1, "unreachable": 1}
        assert (sent.queued, sent.in_flight) == (0, 0)
        got = rx.stats()
        assert got.received_bytes == sum(map(len, data)) and got.receive_seconds >= 0
        assert got.capacity_bytes == 64 * 1024 and got.used_bytes > 0 and got.entries == 3
        assert got.transfers == {"ok": 1, "failed": 1} and got.failed == {"buffer_full": 1}
        finished = rx.take_finished()
        assert [(f.req_id, f.ok, f.reason, f.bytes) for f in finished] == [
            ("a", True, None, sum(map(len, data))),
            ("b", False, "buffer_full", 0),
        ]
        assert rx.take_finished() == []


def test_close_from_inside_on_done_does_not_deadlock_and_ends_the_rest():
    with receiver() as rx:
        tx = PDSender(identity(), 2.0, 5.0)
        first, _ = transfer(rx.init_ports[0], records(1, 100, 100), req_id="first")
        closing = Done()

        def close_then_note(outcome):  # type: ignore[no-untyped-def]
            tx.close()
            closing(outcome)

        later, later_done = transfer(rx.init_ports[0], records(1, 100, 100), req_id="later")
        tx.send(replace(first, on_done=close_then_note))
        tx.send(later)
        assert closing.wait().ok
        assert later_done.wait().reason == "shutdown"
        tx.close()


def _slow_digest(log: list[str]):  # type: ignore[no-untyped-def]
    real = wire.RunningDigest.update

    def update(self, piece):  # type: ignore[no-untyped-def]
        log.append("hashing")
        time.sleep(0.3)
        real(self, piece)
        log.append("hashed")

    return update


def test_on_done_comes_after_the_last_read_of_the_callers_buffers(monkeypatch):
    log: list[str] = []
    monkeypatch.setattr(wire.RunningDigest, "update", _slow_digest(log))
    with socket.create_server((HOST, 0)) as srv:

        def accept_then_hang_up() -> None:  # a decoder that dies right after the allocation
            conn, _ = srv.accept()
            d = wire.Deadline(10)
            answer_handshake(conn)
            wire.recv_frame(conn, d, 10)
            conn.sendall(wire.control_frame(wire.FrameType.REPLY, {"ok": True, "reason": None}))
            conn.close()

        server = threading.Thread(target=accept_then_hang_up)
        server.start()
        tx = PDSender(identity(), 2.0, 5.0)
        t, done = transfer(srv.getsockname()[1], records(2, 8 << 20, 100))
        tx.send(replace(t, on_done=lambda o: (log.append("on_done"), done(o))))
        try:
            assert not done.wait().ok
        finally:
            tx.close()
            server.join()
    assert log[-1] == "on_done" and log.count("hashing") == log.count("hashed")


def test_a_failed_transfers_slots_are_freed_only_after_their_checks_end(monkeypatch):
    log: list[str] = []
    monkeypatch.setattr(wire.RunningDigest, "update", _slow_digest(log))
    real_free = ReceiveBuffer.free

    def free(self, slot):  # type: ignore[no-untyped-def]
        log.append("free")
        real_free(self, slot)

    monkeypatch.setattr(ReceiveBuffer, "free", free)
    with receiver() as rx:
        peer = RawPeer(rx.init_ports[0])
        try:
            assert peer.hello()["ok"] and peer.alloc([4096, 4096])["ok"]
            peer.chunk(0, bytes(4096))
        finally:
            peer.close()  # gone mid-transfer while the first chunk is being checked
        wait_until(lambda: rx.stats().in_flight == 0, what="the transfer dropped")
        assert_idle(rx)
    first_free = log.index("free")
    assert "hashed" in log[:first_free]


def test_transfers_behind_an_unreachable_decoder_do_not_each_wait_out_the_connect_timeout():
    with unanswered_port() as port:
        tx = PDSender(identity(), connect_timeout_s=1.0, io_timeout_s=5.0)
        try:
            pending = [transfer(port, records(1, 10, 10), req_id=f"r{i}") for i in range(6)]
            start = time.monotonic()
            for t, _ in pending:
                tx.send(t)
            outcomes = [done.wait() for _, done in pending]
            waited = time.monotonic() - start
        finally:
            tx.close()
    assert [o.reason for o in outcomes] == ["unreachable"] * 6
    assert waited < 4.0  # one connect timeout (1 s), not six
    assert tx.stats().connections_opened == 0


def test_a_full_queue_ends_the_next_transfer_at_once_as_queue_full():
    with socket.create_server((HOST, 0)) as silent:  # accepts, never answers: the first one waits
        tx = PDSender(identity(), connect_timeout_s=2.0, io_timeout_s=30.0, max_queued=2)
        port = silent.getsockname()[1]
        try:
            first, first_done = transfer(port, records(1, 10, 10), req_id="first")
            tx.send(first)
            conn, _ = silent.accept()  # the first is under way, no longer queued
            queued = [transfer(port, records(1, 10, 10), req_id=f"q{i}") for i in range(2)]
            for t, _ in queued:
                tx.send(t)
            extra, extra_done = transfer(port, records(1, 10, 10), req_id="extra")
            tx.send(extra)
            assert extra_done.wait(timeout=1.0).reason == "queue_full"
            assert tx.stats().queued == 2
        finally:
            tx.close()
            conn.close()
    assert [d.wait().reason for _, d in queued] == ["shutdown", "shutdown"]
    assert first_done.wait().reason == "shutdown"
