"""No PD peer can stall, hang or grow the other side without bound: a whole transfer is bounded on
both sides however slowly its bytes move, one slow decoder never delays the transfers to the
others, kept connections and unreachable marks are dropped as they age, and a reason a peer
sends cannot become a new metric label."""

from __future__ import annotations

import socket
import threading
import time

from bench.lib.ports import free_port
from connector.pd import sender as sender_module
from connector.pd import wire
from connector.pd.sender import PDSender

from .pd_wire_support import (
    HOST,
    RawPeer,
    answer_handshake,
    assert_idle,
    identity,
    open_fds,
    receiver,
    records,
    send,
    transfer,
    wait_until,
)


class TrickleProxy:
    """Relays to ``port``, passing what the sender writes at ``rate`` bytes per second (its
    small receive buffer makes the sender's writes block) and the answers at once."""

    def __init__(self, port: int, rate: int = 256 * 1024) -> None:
        self._target, self._rate = port, rate
        self._listener = socket.create_server((HOST, 0))
        self.port = self._listener.getsockname()[1]
        self._socks: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except OSError:
            return
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        server = socket.create_connection((HOST, self._target))
        self._socks += [client, server]
        threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
        threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, slow: bool) -> None:
        piece = max(1, self._rate // 20)
        try:
            while data := src.recv(piece if slow else 1 << 20):
                dst.sendall(data)
                if slow:
                    time.sleep(len(data) / self._rate)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        for s in self._socks:
            s.close()


def test_a_decoder_that_reads_a_trickle_ends_the_transfer_at_its_bound_and_delays_no_other_decoder():
    with receiver(buffer_bytes=64 << 20, transfer_timeout_s=60.0) as slow_rx, receiver() as healthy_rx:
        proxy = TrickleProxy(slow_rx.init_ports[0])
        tx = PDSender(identity(), 2.0, 1.0)  # as engines make it: the io bound is the transfer's
        try:
            slow, slow_done = transfer(proxy.port, records(2, 8 << 20, 8 << 20), req_id="slow")
            tx.send(slow)
            time.sleep(0.3)  # the slow one is under way
            sent_at = time.monotonic()
            assert send(tx, healthy_rx.init_ports[0], records(1, 4096, 4096), req_id="healthy").ok
            assert time.monotonic() - sent_at < 1.0  # it did not wait behind the slow decoder
            outcome = slow_done.wait()
        finally:
            tx.close()
            proxy.close()
        # 16 MiB at 256 KiB/s would take a minute: the whole transfer's bound ended it
        assert not outcome.ok and outcome.reason in ("timeout", "peer_closed")
        assert outcome.seconds < 3.0


def test_a_prefiller_trickling_frames_loses_its_slots_at_the_transfers_bound():
    with receiver(transfer_timeout_s=1.0) as rx:
        peer = RawPeer(rx.init_ports[0])
        assert peer.hello()["ok"] and peer.alloc([1024] * 8)["ok"]
        started = time.monotonic()
        try:
            for i in range(8):  # each frame well within the bound, the whole transfer far beyond it
                peer.chunk(i, bytes(1024))
                time.sleep(0.5)
        except OSError:
            pass
        assert peer.closed_by_peer()
        peer.close()
        wait_until(lambda: rx.stats().in_flight == 0, what="the transfer ended")
        assert rx.stats().failed == {"timeout": 1}
        assert time.monotonic() - started < 3.0
        assert_idle(rx)


def test_kept_connections_close_once_idle_even_if_their_decoder_never_comes_back(monkeypatch):
    monkeypatch.setattr(sender_module, "POOLED_IDLE_S", 0.5)
    monkeypatch.setattr(sender_module, "SWEEP_S", 0.1, raising=False)
    fds = open_fds()
    receivers = [receiver() for _ in range(12)]
    rxs = [r.__enter__() for r in receivers]
    tx = PDSender(identity(), 2.0, 5.0)
    try:
        with_receivers = open_fds()
        for i, rx in enumerate(rxs):  # one transfer to each: twelve connections kept
            assert send(tx, rx.init_ports[0], records(1, 64, 64), req_id=f"r{i}").ok
        assert open_fds() >= with_receivers + 12
        wait_until(lambda: open_fds() <= with_receivers + 1, timeout=10.0, what="kept connections closed")
    finally:
        tx.close()
        for r in receivers:
            r.__exit__(None, None, None)
    wait_until(lambda: open_fds() == fds, what="everything closed")


def test_at_most_max_pooled_connections_are_kept(monkeypatch):
    monkeypatch.setattr(sender_module, "MAX_POOLED", 3, raising=False)
    receivers = [receiver() for _ in range(6)]
    rxs = [r.__enter__() for r in receivers]
    tx = PDSender(identity(), 2.0, 5.0)
    try:
        for i, rx in enumerate(rxs):
            assert send(tx, rx.init_ports[0], records(1, 64, 64), req_id=f"r{i}").ok
        assert tx.stats().connections_kept == 3
        wait_until(lambda: sum(rx.stats().connections for rx in rxs) == 3, what="the oldest closed")
    finally:
        tx.close()
        for r in receivers:
            r.__exit__(None, None, None)


def test_unreachable_decoders_are_forgotten_once_their_mark_expires(monkeypatch):
    monkeypatch.setattr(sender_module, "SWEEP_S", 0.1, raising=False)
    tx = PDSender(identity(), connect_timeout_s=2.0, io_timeout_s=5.0)
    try:
        for _ in range(30):  # refused at once: each marks its port for the connect timeout
            assert send(tx, free_port(), records(1, 64, 64)).reason == "unreachable"
        assert len(tx._down_until) > 0
        # the idle lanes prune the marks as they expire
        wait_until(lambda: len(tx._down_until) == 0, timeout=20.0, what="marks forgotten")
    finally:
        tx.close()


def test_the_unreachable_marks_are_capped(monkeypatch):
    monkeypatch.setattr(sender_module, "MAX_DOWN", 5, raising=False)
    tx = PDSender(identity(), connect_timeout_s=0.2, io_timeout_s=1.0)
    try:
        for _ in range(12):
            assert send(tx, free_port(), records(1, 64, 64)).reason == "unreachable"
        assert len(tx._down_until) == 5
    finally:
        tx.close()


def _receiver_with_reasons(srv: socket.socket, n: int) -> None:
    """A decoder that shakes hands, then refuses each of ``n`` allocations with a new reason."""
    conn, _ = srv.accept()
    with conn:
        answer_handshake(conn)
        for i in range(n):
            wire.recv_frame(conn, wire.Deadline(10), 10)
            conn.sendall(
                wire.control_frame(wire.FrameType.REPLY, {"ok": False, "reason": f"evil-{i}:{'x' * 50}"})
            )


def test_a_reason_the_decoder_invents_never_becomes_a_new_label():
    with socket.create_server((HOST, 0)) as srv:
        fake = threading.Thread(target=_receiver_with_reasons, args=(srv, 50))
        fake.start()
        tx = PDSender(identity(), 2.0, 5.0)
        try:
            outcomes = [send(tx, srv.getsockname()[1], records(1, 64, 64), req_id=f"t{i}") for i in range(50)]
        finally:
            tx.close()
            fake.join()
    assert {o.reason for o in outcomes} == {"bad_reply"}
    assert tx.stats().failed == {"bad_reply": 50}
