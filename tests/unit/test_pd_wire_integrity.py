"""PD integrity: every chunk is checked (xxh3-64) before it is indexed, a mismatch fails the
whole transfer and frees its slots, and the bytes move without extra copies (sent from the
caller's memoryview, read with recv_into straight into the shared-memory slot)."""

from __future__ import annotations

import os
import socket
import threading
import time
import tracemalloc

import pytest
import xxhash

from connector.pd import sender as sender_module
from connector.pd import wire
from connector.pd.auth import PDAuth
from connector.pd.receive_buffer import attach
from connector.pd.sender import PDSender

from .pd_wire_support import RawPeer, assert_idle, identity, receiver, records, send


def test_a_chunk_whose_checksum_does_not_match_fails_the_transfer_and_frees_its_slots(monkeypatch):
    calls = []
    real = sender_module.wire.RunningDigest.trailer

    def lying(self):  # type: ignore[no-untyped-def]  # the second chunk's checksum is wrong
        calls.append(1)
        trailer = real(self)
        return bytes([trailer[0] ^ 1]) + trailer[1:] if len(calls) == 2 else trailer

    monkeypatch.setattr(sender_module.wire.RunningDigest, "trailer", lying)
    with receiver() as rx:
        tx = PDSender(identity(), 2.0, 5.0)
        try:
            outcome = send(tx, rx.init_ports[0], records(3, 8192, 100))
            assert not outcome.ok and outcome.reason == "checksum"
            assert rx.present(["proxy-1-k0"]) == 0  # not even the chunks that were right
            assert rx.stats().failed == {"checksum": 1}
            assert_idle(rx)
            monkeypatch.undo()
            assert send(tx, rx.init_ports[0], records(2, 8192, 100), req_id="next").ok  # still in step
        finally:
            tx.close()


def test_bytes_changed_on_the_way_are_caught_by_the_receiver():
    with receiver() as rx:
        peer = RawPeer(rx.init_ports[0])
        try:
            assert peer.hello()["ok"]
            data = records(2, 4096, 4096)
            assert peer.alloc([4096, 4096], keys=["x", "y"])["ok"]
            peer.chunk(0, data[0])
            flipped = bytes([data[1][0] ^ 0x80]) + data[1][1:]
            peer.chunk(1, flipped, digest=xxhash.xxh3_64_intdigest(data[1]))
            assert peer.end() == {"ok": False, "reason": "checksum"}
            assert rx.present(["x"]) == 0
            assert_idle(rx)
        finally:
            peer.close()


def test_chunks_travel_without_a_copy_in_python_memory():
    size = 4 << 20  # a realistic record: 256 tokens of the bench model
    data = records(4, size, size // 2)
    with receiver(buffer_bytes=32 << 20) as rx:
        tx = PDSender(identity(), 2.0, 30.0)
        try:
            send(tx, rx.init_ports[0], records(1, 1024, 1024), req_id="warm")  # connection and threads up
            tracemalloc.start()
            try:
                outcome = send(tx, rx.init_ports[0], data)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
        finally:
            tx.close()
        assert outcome.ok
        assert peak < size // 8, f"{peak} bytes allocated while moving {len(data)} chunks of {size}"
        claim = rx.claim([f"proxy-1-k{i}" for i in range(4)], "d")
        worker = attach(claim.locations[0][0].buffer_name)
        assert [bytes(worker.view(loc[0].offset, loc[0].length)) for loc in claim.locations] == data
        worker.close()
        rx.release("d")


def test_the_checksum_of_a_record_hashed_in_pieces_is_its_xxh3_64():
    for size in (1, wire.HASH_PIECE - 1, wire.HASH_PIECE, 3 * wire.HASH_PIECE + 17):
        data = memoryview(records(1, size, size)[0])
        assert wire.digest(data) == xxhash.xxh3_64_intdigest(data)


@pytest.mark.parametrize("keyed", [False, True], ids=["xxh3", "aes-gcm"])
def test_a_trailer_computed_piece_by_piece_as_the_bytes_pass_equals_the_one_shot_trailer(keyed):
    key = PDAuth(b"a PD key of at least 16 bytes")
    trailers = key.session(b"s" * 32, b"r" * 32) if keyed else wire.Checksums()
    for size in (1, 100, wire.CHECK_PIECE - 1, wire.CHECK_PIECE, 2 * wire.CHECK_PIECE + 17):
        data = memoryview(os.urandom(size))
        whole = trailers.tag(3, "req", "key", 5, 256, data)
        for split in (s for s in (1, 7, 4093, wire.CHECK_PIECE) if size // s <= 1000):
            running = trailers.begin(3, "req", "key", 5, 256, size)
            for start in range(0, size, split):
                running.update(data[start : start + split])
            assert running.trailer() == whole, (size, split)
        if keyed:  # another index: another tag
            other = trailers.begin(3, "req", "key", 6, 256, size)
            other.update(data)
            assert other.trailer() != whole


def test_a_kernel_timeout_kept_from_a_short_bound_does_not_cut_a_longer_one_short():
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(wire.Timeout):  # a bound of 50 ms, nothing sent: times out
            wire.recv_into(a, memoryview(bytearray(1)), wire.Deadline(0.05), 5.0)
        threading.Timer(0.3, b.sendall, (b"x",)).start()
        got = bytearray(1)
        wire.recv_into(a, memoryview(got), wire.Deadline(5.0), 5.0)  # waits the 0.3 s
        assert got == b"x"
        start = time.monotonic()
        with pytest.raises(wire.Timeout):  # and a deadline still ends a silent wait on time
            wire.recv_into(a, memoryview(got), wire.Deadline(0.2), 5.0)
        assert 0.15 < time.monotonic() - start < 0.2 + 0.1


def test_a_record_is_checked_in_pieces_of_about_a_mib_with_no_small_remainder():
    mib = wire.CHECK_PIECE
    for nbytes in (1, 384, mib, mib + 384, int(1.6 * mib), 4 * mib + 384, 16 * mib - 1):
        step = wire._piece_bytes(nbytes)
        pieces = [min(step, nbytes - start) for start in range(0, nbytes, step)]
        assert sum(pieces) == nbytes
        assert len(pieces) == max(1, round(nbytes / mib))  # a 1 MiB record's header is not a piece
        assert len(pieces) == 1 or (step % 64 == 0 and min(pieces) > mib // 2)
