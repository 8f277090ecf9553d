"""PD data plane, the happy path: chunks sent from a prefiller rank's memoryviews arrive
byte-exact in the decoder's shared memory, are found, claimed, read by a worker, released."""

from __future__ import annotations

import socket
import threading
from dataclasses import replace
from typing import Union

import msgspec
import pytest
import zmq

from bench.lib.ports import free_port
from connector.pd.proxy_notice import ProxyNotifier
from connector.pd.receive_buffer import attach
from connector.pd.receiver import PDReceiver
from connector.pd.sender import PDSender

from .pd_wire_support import (
    HOST,
    assert_idle,
    identity,
    open_fds,
    pd_threads,
    receiver,
    records,
    send,
    transfer,
)


def test_chunks_arrive_byte_exact_and_a_worker_reads_them_in_place():
    data = records(4, 64 * 1024, 10_000)  # the last chunk shorter: the prompt's unfull tail
    keys = [f"key-{i}" for i in range(4)]
    with receiver() as rx:
        tx = PDSender(identity(), connect_timeout_s=2.0, io_timeout_s=5.0)
        try:
            outcome = send(tx, rx.init_ports[0], data, keys=keys)
        finally:
            tx.close()
        assert outcome.ok, outcome
        assert outcome.reason is None and outcome.bytes == sum(map(len, data))
        assert rx.present(keys) == 4
        assert rx.present([*keys, "unknown"]) == 4
        assert rx.present(["unknown", *keys]) == 0
        assert rx.present(keys[:2]) == 2
        stats = rx.stats()
        assert stats.entries == 4 and stats.used_bytes >= sum(map(len, data))
        assert stats.received_bytes == sum(map(len, data)) and stats.transfers == {"ok": 1}

        claim = rx.claim(keys, "decode-1")
        assert claim is not None
        assert claim.keys == tuple(keys) and claim.req_id == "proxy-1"
        assert claim.tokens == 4 * 256 and claim.bytes == sum(map(len, data))
        assert claim.transfer_ms >= 0
        worker = attach(claim.locations[0][0].buffer_name)
        try:
            for i, chunk in enumerate(data):
                loc = claim.locations[i][0]
                view = worker.view(loc.offset, loc.length)
                assert view.readonly
                assert bytes(view) == chunk
                view.release()
        finally:
            worker.close()
        rx.release("decode-1")
        assert rx.present(keys) == 0
        assert_idle(rx)
        assert rx.stats().released == 4


def test_a_key_counts_as_present_only_once_every_rank_has_it():
    data = records(3, 8192, 100)
    keys = ["a", "b", "c"]
    with receiver(tp=2) as rx:
        senders = [PDSender(identity(r, tp=2), 2.0, 5.0) for r in range(2)]
        try:
            assert send(senders[0], rx.init_ports[0], data, keys=keys).ok
            assert rx.present(keys) == 0
            assert rx.claim(keys, "early") is None
            rank1 = [bytes(reversed(c)) for c in data]
            assert send(senders[1], rx.init_ports[1], rank1, keys=keys).ok
        finally:
            for s in senders:
                s.close()
        assert rx.present(keys) == 3
        claim = rx.claim(keys, "decode")
        assert claim is not None and claim.bytes == 2 * sum(map(len, data))
        for rank, expected in ((0, data), (1, rank1)):
            worker = attach(claim.locations[0][rank].buffer_name)
            got = [bytes(worker.view(loc[rank].offset, loc[rank].length)) for loc in claim.locations]
            worker.close()
            assert got == expected
        rx.release("decode")
        assert_idle(rx)


def test_on_done_runs_once_on_the_senders_thread_and_nothing_is_left_after_close():
    fds, threads = open_fds(), pd_threads()
    with receiver() as rx:
        tx = PDSender(identity(), 2.0, 5.0)
        t, done = transfer(rx.init_ports[0], records(2, 4096, 10))
        tx.send(t)
        done.wait()
        tx.close()
        assert len(done.outcomes) == 1 and done.threads[0].startswith("kvlens-pd-send")
        assert done.threads[0] != threading.current_thread().name
        assert tx.stats().transfers == {"ok": 1} and tx.stats().in_flight == 0
    assert pd_threads() == threads
    assert open_fds() == fds


# The proxy's side, written from LMCache's example proxy: tagged msgspec structs in a Union.
class ProxyNotif(msgspec.Struct, tag=True):
    req_id: str


class OtherPDMsg(msgspec.Struct, tag=True):
    req_id: str
    detail: int


PDMsg = Union[ProxyNotif, OtherPDMsg]  # noqa: UP007 (written as LMCache writes it)


def test_the_proxy_decodes_the_notice_as_lmcaches_proxy_does():
    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port(f"tcp://{HOST}")
    notifier = ProxyNotifier(HOST, port)
    try:
        assert notifier.notify("proxy-req-7")
        assert pull.poll(10_000), "no notice arrived"
        raw = pull.recv()
        assert msgspec.msgpack.decode(raw) == {"type": "ProxyNotif", "req_id": "proxy-req-7"}
        msg = msgspec.msgpack.decode(raw, type=PDMsg)
        assert isinstance(msg, ProxyNotif) and msg.req_id == "proxy-req-7"
        assert (notifier.sent, notifier.failed) == (1, 0)
    finally:
        notifier.close()
        pull.close(linger=0)


def test_a_notice_with_no_proxy_listening_is_dropped_in_bounded_time_and_counted():
    notifier = ProxyNotifier(HOST, free_port(), send_timeout_s=0.2, linger_s=0.0)
    try:
        assert notifier.notify("lost") is False
        assert (notifier.sent, notifier.failed) == (0, 1)
    finally:
        notifier.close()
    assert notifier.notify("after-close") is False


def test_a_receiver_on_an_ipv6_address_is_reached():
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    rx = PDReceiver([identity()], "::1", [0], [0], 1 << 20, transfer_timeout_s=5.0, unclaimed_timeout_s=60.0)
    rx.start()
    tx = PDSender(identity(), 2.0, 5.0)
    try:
        t, done = transfer(rx.init_ports[0], records(1, 100, 100))
        tx.send(replace(t, host="::1"))
        assert done.wait().ok and rx.present(["proxy-1-k0"]) == 1
    finally:
        tx.close()
        rx.close()
