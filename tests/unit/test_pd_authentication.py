"""PD over a network that is not trusted: with a shared key only the operator's prefillers can hand
a decoder KV, a receiver must prove the key before any KV leaves for it, a refused peer learns
nothing about the receiver, and a chunk moved, replayed or changed fails its keyed tag. Real
sockets on loopback, hostile peers written by hand."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from connector.pd import wire
from connector.pd.auth import PDAuth
from connector.pd.probe import probe_receiver
from connector.pd.sender import PDSender

from .pd_wire_support import (
    HOST,
    RawPeer,
    assert_idle,
    identity,
    receiver,
    records,
    send,
    tls_files_in,
    transfer,
    wait_until,
)


@pytest.fixture
def tls_files(tmp_path):  # type: ignore[no-untyped-def]
    return tls_files_in(str(tmp_path))


KEY = PDAuth(b"operator's PD key, 32 characters")
OTHER = PDAuth(b"an attacker's guess at the key!!")


def test_a_keyed_pair_transfers_and_indexes_every_chunk():
    with receiver(auth=KEY) as rx:
        tx = PDSender(identity(), 2.0, 5.0, auth=KEY)
        try:
            chunks = records(3, 4096, 100)
            assert send(tx, rx.init_ports[0], chunks, req_id="keyed").ok
            assert send(tx, rx.init_ports[0], records(2, 512, 512, seed=1), req_id="again").ok  # seq 1
        finally:
            tx.close()
        assert rx.present([f"keyed-k{i}" for i in range(3)]) == 3
        assert rx.stats().failed == {}


@pytest.mark.parametrize("senders_key", [None, OTHER], ids=["no key", "another key"])
def test_a_sender_without_the_key_is_refused_and_learns_nothing_about_the_receiver(senders_key):
    with receiver(auth=KEY) as rx:
        peer = RawPeer(rx.init_ports[0])
        answer = peer.hello(auth=senders_key)
        assert answer == {"ok": False, "reason": "auth_failed"}  # no identity, no capacity
        assert peer.first["proof"] is not None and set(peer.first) == {"version", "nonce", "proof"}
        assert peer.closed_by_peer()
        peer.close()
        wait_until(lambda: rx.stats().connections == 0, what="the connection ended")
        assert rx.stats().failed == {"auth_failed": 1}
        assert_idle(rx)
        tx = PDSender(identity(), 2.0, 5.0, auth=senders_key)
        try:
            outcome = send(tx, rx.init_ports[0], records(1, 1024, 1024), req_id="forged")
        finally:
            tx.close()
        assert not outcome.ok and outcome.reason == "auth_failed"
        assert rx.present(["forged-k0"]) == 0


def test_a_receiver_without_a_key_never_reveals_its_identity_to_a_peer_it_refuses():
    with receiver() as rx:  # loopback, no key: a mismatch is answered, but only after the peer spoke
        peer = RawPeer(rx.init_ports[0])
        peer.send(
            wire.control_frame(wire.FrameType.HELLO, {"version": wire.VERSION, "nonce": os.urandom(32)})
        )
        assert set(peer.reply()) == {"version", "nonce", "proof"}
        peer.close()


def _echoing_receiver(srv: socket.socket, got: list[bytes], done: threading.Event) -> None:
    """A fake decoder that answers every handshake with the sender's own identity (public) and
    records whatever arrives after: what would leave for it."""
    conn, _ = srv.accept()
    try:
        d = wire.Deadline(10)
        _, body = wire.recv_frame(conn, d, 10)
        nonce = os.urandom(32)
        conn.sendall(
            wire.control_frame(wire.FrameType.REPLY, {"version": wire.VERSION, "nonce": nonce, "proof": None})
        )
        conn.settimeout(5)
        while chunk := conn.recv(1 << 20):
            got.append(chunk)
    except OSError:
        pass
    finally:
        conn.close()
        done.set()


def test_a_sender_with_the_key_sends_nothing_to_a_receiver_that_cannot_prove_it():
    got: list[bytes] = []
    done = threading.Event()
    with socket.create_server((HOST, 0)) as srv:
        fake = threading.Thread(target=_echoing_receiver, args=(srv, got, done))
        fake.start()
        tx = PDSender(identity(), 2.0, 5.0, auth=KEY)
        try:
            outcome = send(tx, srv.getsockname()[1], records(2, 4096, 4096))
        finally:
            tx.close()
            fake.join()
    assert not outcome.ok and outcome.reason == "auth_failed"
    assert b"".join(got) == b""  # not even the identity: the first frame was the HELLO


def test_a_chunk_replayed_on_another_connection_fails_its_tag():
    """A holder of nothing but a recording of a genuine transfer cannot replay it."""
    with receiver(auth=KEY) as rx:
        data = records(1, 4096, 4096)[0]
        first = RawPeer(rx.init_ports[0])
        assert first.hello(auth=KEY)["ok"] and first.alloc([4096], keys=["k"], req_id="r")["ok"]
        recorded = first.trailers.tag(0, "r", "k", 0, 256, memoryview(data))
        first.chunk(0, data)
        assert first.end()["ok"]
        claim = rx.claim(["k"], "d")
        rx.release(claim.request_id)
        second = RawPeer(rx.init_ports[0])
        assert second.hello(auth=KEY)["ok"] and second.alloc([4096], keys=["k"], req_id="r")["ok"]
        second.send(wire.chunk_header(0, 4096), data, recorded)  # the first connection's tag
        assert second.end() == {"ok": False, "reason": "checksum"}
        assert rx.present(["k"]) == 0
        first.close()
        second.close()


@pytest.mark.parametrize(
    "moved",
    [
        dict(seq=1),  # another transfer of the same connection
        dict(req_id="other"),
        dict(key="other-key"),
        dict(index=1),
        dict(tokens=255),
        dict(flip=True),  # one byte changed
    ],
)
def test_a_tag_binds_the_transfer_the_key_the_index_the_tokens_and_the_bytes(moved):
    with receiver(auth=KEY) as rx:
        chunks = records(2, 4096, 4096)
        peer = RawPeer(rx.init_ports[0])
        assert peer.hello(auth=KEY)["ok"] and peer.alloc([4096, 4096], keys=["a", "b"], req_id="r")["ok"]
        peer.chunk(1, chunks[1])
        args = {"seq": 0, "req_id": "r", "key": "a", "index": 0, "tokens": 256, **moved}
        data = bytearray(chunks[0])
        tag = peer.trailers.tag(
            args["seq"], args["req_id"], args["key"], args["index"], args["tokens"], memoryview(data)
        )
        if moved.get("flip"):
            data[100] ^= 1
        peer.send(wire.chunk_header(0, 4096), bytes(data), tag)
        assert peer.end() == {"ok": False, "reason": "checksum"}
        assert rx.present(["a", "b"]) == 0 and rx.stats().failed == {"checksum": 1}
        peer.close()


def test_a_probe_with_the_key_sees_the_receiver_and_one_without_sees_nothing():
    with receiver(auth=KEY) as rx:
        seen = probe_receiver(HOST, rx.alloc_ports[0], identity(), auth=KEY)
        assert seen.ok and seen.identity == identity() and seen.capacity_bytes > 0
        blind = probe_receiver(HOST, rx.alloc_ports[0], identity())
        assert not blind.ok and blind.reason == "auth_failed" and blind.identity is None
        assert blind.capacity_bytes == 0


def test_refusals_are_logged_once_per_interval_not_once_per_peer(caplog):
    with receiver(auth=KEY) as rx:
        for _ in range(20):
            peer = RawPeer(rx.init_ports[0])
            assert peer.hello()["reason"] == "auth_failed"
            peer.close()
        wait_until(lambda: rx.stats().failed.get("auth_failed") == 20, what="20 refusals counted")
    loud = [r for r in caplog.records if r.levelname == "WARNING" and "did not prove" in r.getMessage()]
    assert len(loud) == 1


def test_tls_with_the_key_carries_a_transfer_and_a_sender_that_does_not_trust_the_certificate_is_refused(
    tls_files,
):
    from connector.pd.tls import ClientTLS, ServerTLS, TLSFiles

    server = ServerTLS(TLSFiles(tls_files.cert, tls_files.key))
    with receiver(buffer_bytes=8 << 20, auth=KEY, tls=server) as rx:
        trusting = PDSender(identity(), 2.0, 5.0, auth=KEY, tls=ClientTLS(TLSFiles(ca_file=tls_files.cert)))
        stranger = PDSender(identity(), 2.0, 5.0, auth=KEY, tls=ClientTLS(TLSFiles(ca_file=tls_files.other)))
        try:
            assert send(trusting, rx.init_ports[0], records(3, 1 << 20, 4096), req_id="tls").ok
            refused = send(stranger, rx.init_ports[0], records(1, 4096, 4096), req_id="nope")
        finally:
            trusting.close()
            stranger.close()
        assert rx.present([f"tls-k{i}" for i in range(3)]) == 3
        assert not refused.ok and refused.reason == "tls_failed"
        t, done = transfer(rx.init_ports[0], records(1, 10, 10))
        plain = PDSender(identity(), 2.0, 5.0, auth=KEY)  # no TLS at all: the receiver's handshake fails
        try:
            plain.send(t)
            assert not done.wait().ok
        finally:
            plain.close()
