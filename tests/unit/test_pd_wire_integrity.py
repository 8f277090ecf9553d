"""PD integrity: every chunk is checked (xxh3-64) before it is indexed, a mismatch fails the
whole transfer and frees its slots, and the bytes move without extra copies (sent from the
caller's memoryview, read with recv_into straight into the shared-memory slot)."""

from __future__ import annotations

import tracemalloc

import xxhash

from connector.pd import sender as sender_module
from connector.pd import wire
from connector.pd.receive_buffer import attach
from connector.pd.sender import PDSender

from .pd_wire_support import RawPeer, assert_idle, identity, receiver, records, send


def test_a_chunk_whose_checksum_does_not_match_fails_the_transfer_and_frees_its_slots(monkeypatch):
    calls = []

    def lying(data):  # the second chunk's checksum is wrong
        calls.append(len(data))
        digest = xxhash.xxh3_64_intdigest(data)
        return digest ^ 1 if len(calls) == 2 else digest

    monkeypatch.setattr(sender_module.wire, "digest", lying)
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
