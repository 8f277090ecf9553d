"""How the remote tier moves values: loads read into reused buffers, never into one still viewed;
stores send the payload uncopied; a reply broken off mid-value fails the batch and leaves no
connection out of step; RESP3 connections still go through redis-py."""

from __future__ import annotations

import socket
import time
import tracemalloc
import warnings

import pytest
import torch

from connector.tiers import codec, redis_wire
from connector.tiers.base import ChunkCorrupt, ChunkMissing
from connector.tiers.redis_tier import RemoteUnavailable

from .helpers import MB, name, payload
from .proxy import Relay
from .servers import OPENSSL, make_certificates


def _tensor(view: memoryview) -> torch.Tensor:
    """What the worker's copier makes of a loaded payload (it holds the view)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(view, dtype=torch.uint8)


def test_loads_reuse_their_buffers_once_the_payloads_are_dropped(redis_server, tier_factory):
    tier = tier_factory(redis_server.url)
    names = [name(i) for i in range(4)]
    tier.put_many([(n, payload(MB, i)) for i, n in enumerate(names)])
    first = tier.get_many(names)
    assert all(isinstance(v, memoryview) for v in first)
    buffers = {id(v.obj) for v in first}
    del first  # buffers exist, all dropped
    held = tier.read_buffers.bytes
    tracemalloc.start()
    try:
        got = tier.get_many(names)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == [payload(MB, i) for i in range(4)]
    assert peak < MB / 4  # 4 MiB read, none of it into new memory (Python's allocator)...
    assert {id(v.obj) for v in got} == buffers and tier.read_buffers.bytes == held  # ...nor maps


def test_a_payload_still_viewed_is_never_overwritten_by_later_loads(redis_server, tier_factory):
    tier = tier_factory(redis_server.url)
    tier.put_many([(name(1), payload(MB, 1)), (name(2), payload(MB, 2))])
    held = _tensor(tier.get(name(1)))  # a copy thread's view: only the tensor keeps the buffer
    sliced = tier.get_many([name(1)])[0][100:200]  # a slice alone keeps its buffer too
    for _ in range(3):
        assert tier.get(name(2)) == payload(MB, 2)
    assert bytes(held.numpy()) == bytes(payload(MB, 1))
    assert sliced == payload(MB, 1)[100:200]


def test_loaded_payloads_are_read_only(redis_server, tier_factory):
    tier = tier_factory(redis_server.url)
    tier.put(name(1), payload(1000))
    view = tier.get(name(1))
    assert view.readonly
    with pytest.raises(TypeError):
        view[0] = 1


def test_put_many_sends_payloads_without_copying_them(redis_server, tier_factory):
    tier = tier_factory(redis_server.url)
    items = [(name(i), payload(MB, i)) for i in range(8)]
    tier.put_many(items)  # connections exist before measuring
    tracemalloc.start()
    try:
        assert tier.put_many(items) == [None] * 8
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MB / 4
    assert tier.get_many([n for n, _ in items]) == [p for _, p in items]


@pytest.fixture
def relay(redis_server):
    relay = Relay(redis_server.port)
    yield relay
    relay.close()


def test_a_reply_cut_mid_value_fails_the_batch_and_the_next_call_reads_clean(relay, tier_factory):
    tier = tier_factory(relay.url, timeout_s=2.0)
    tier.put_many([(name(1), payload(MB, 1)), (name(2), payload(MB, 2))])
    relay.cut(after=MB // 2)
    got = tier.get_many([name(1), name(2)])
    assert all(isinstance(g, RemoteUnavailable) and g.kind == "connection" for g in got)
    relay.release()
    assert tier.get_many([name(2), name(1)]) == [payload(MB, 2), payload(MB, 1)]


def test_a_reply_stalled_mid_value_times_out_and_its_late_bytes_are_never_read(relay, tier_factory):
    tier = tier_factory(relay.url, timeout_s=0.3)
    tier.put_many([(name(1), payload(MB, 1)), (name(2), payload(MB, 2))])
    relay.stall(after=MB + MB // 2)  # the first value and half the second
    start = time.monotonic()
    got = tier.get_many([name(1), name(2)])
    assert time.monotonic() - start < 2.0
    assert all(isinstance(g, RemoteUnavailable) and g.kind == "timeout" for g in got)
    relay.release()  # the rest of the old reply arrives now, on a connection the tier dropped
    # Every read after it returns its own value, never the old reply's bytes. A read may still
    # time out (0.3 s for 1 MB through the relay: on a slowed CPU some did), but three of each
    # must come back, within twenty tries.
    served = {1: 0, 2: 0}
    for _ in range(20):
        for n in (2, 1):
            try:
                got = tier.get(name(n))
            except RemoteUnavailable as e:
                assert e.kind == "timeout", e
                continue
            assert got == payload(MB, n)
            served[n] += 1
        if min(served.values()) >= 3:
            break
    assert min(served.values()) >= 3, served


def test_error_and_nil_replies_amid_values_leave_the_connection_usable(redis_server, tier_factory):
    tier = tier_factory(redis_server.url, key_prefix="wire-mixed")
    tier.put_many([(name(0), payload(300_000, 0)), (name(2), payload(300_000, 2))])
    with redis_server.client() as raw:
        raw.rpush(f"wire-mixed:{name(1)}", b"not a record")  # GET answers WRONGTYPE
    for _ in range(2):
        good, wrong, missing, good2 = tier.get_many([name(0), name(1), name(9), name(2)])
        assert good == payload(300_000, 0) and good2 == payload(300_000, 2)
        assert isinstance(wrong, ChunkCorrupt) and isinstance(missing, ChunkMissing)


def test_resp3_connections_go_through_redis_py_and_still_check_records(redis_server, tier_factory):
    tier = tier_factory(redis_server.url + "?protocol=3", key_prefix="resp3")
    (client,) = tier._nodes.masters()
    assert not redis_wire.fast_path(client)
    items = [(name(i), payload(200_000, i)) for i in range(3)]
    assert tier.put_many(items) == [None] * 3
    assert tier.get_many([n for n, _ in items]) == [p for _, p in items]
    with redis_server.client() as raw:
        raw.setrange(f"resp3:{name(1)}", 500, b"\xff\x00")
    assert isinstance(tier.get_many([name(1)])[0], ChunkCorrupt)
    assert isinstance(tier.get_many([name(7)])[0], ChunkMissing)


def test_resp2_connections_take_the_direct_path(redis_server, tier_factory):
    (client,) = tier_factory(redis_server.url)._nodes.masters()
    assert redis_wire.fast_path(client)


class _WatchedSocket(socket.socket):
    """A connection's socket that notes the bytes sent through it."""

    sent: list[int]

    def sendmsg(self, buffers, *args):  # noqa: ANN001, ANN201
        n = super().sendmsg(buffers, *args)
        self.sent.append(n)
        return n

    def sendall(self, data, *args):  # noqa: ANN001, ANN201
        super().sendall(data, *args)
        self.sent.append(memoryview(data).nbytes)


def _watch_sends(client) -> list[int]:  # noqa: ANN001
    """Replace the socket of ``client``'s one pooled connection by one that notes its sends."""
    pool = client.connection_pool
    conn = pool.get_connection("SET") if redis_wire._NAMED else pool.get_connection()
    try:
        old = conn._sock
        watched = _WatchedSocket(old.family, old.type, old.proto, fileno=old.detach())
        watched.settimeout(old.gettimeout())
        watched.sent = []
        conn._sock = watched
        conn._parser.on_connect(conn)  # redis-py's reader of the connection reads the new socket
    finally:
        pool.release(conn)
    return watched.sent


def test_put_many_sends_each_record_before_checksumming_the_next(redis_server, tier_factory, monkeypatch):
    """A record's header (its payload's checksum) is made while the server reads the record
    before it, not all headers before the first byte goes out."""
    tier = tier_factory(redis_server.url)
    tier.put(name(9), payload(100))  # the pool holds one connection
    (client,) = tier._nodes.masters()
    sent = _watch_sends(client)
    sent_at_header: list[int] = []
    original = codec.encode_header

    def encode_header(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        sent_at_header.append(sum(sent))
        return original(*args, **kwargs)

    monkeypatch.setattr(codec, "encode_header", encode_header)
    items = [(name(i), payload(MB, i)) for i in range(4)]
    assert tier.put_many(items) == [None] * 4
    assert len(sent_at_header) == 4
    assert all(sent_at_header[i] >= i * MB for i in range(4)), sent_at_header
    assert tier.get_many([n for n, _ in items]) == [p for _, p in items]


def test_small_pieces_go_out_joined_and_large_payloads_as_they_are():
    large = memoryview(bytearray(b"L" * 100_000))
    frames = [[b"h1", memoryview(b"p1"), b"t1"], [b"h2", large, b"t2"], [b"h3" * 20_000, b"t3" * 20_000]]
    pieces = redis_wire._coalesced(frames)
    assert pieces[0] == b"h1p1t1h2" and pieces[1] is large
    assert b"".join(pieces) == b"".join(b"".join(f) for f in frames)
    assert all(len(p) <= 64 * 1024 for p in pieces if p is not large)


def test_tls_connections_take_the_direct_path_for_batches(tmp_path, server_factory, tier_factory):
    if not OPENSSL:
        pytest.skip("openssl is not installed")
    certs = make_certificates(tmp_path / "certs")
    server = server_factory(tls=certs)
    tier = tier_factory(f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={certs / 'ca.pem'}")
    (client,) = tier._nodes.masters()
    assert redis_wire.fast_path(client)
    items = [(name(i), payload(2 * MB, i)) for i in range(3)]
    assert tier.put_many(items) == [None] * 3
    for _ in range(2):
        assert tier.get_many([n for n, _ in items] + [name(9)])[:3] == [p for _, p in items]


def test_a_redis_py_whose_sockets_cannot_be_read_falls_back_to_its_pipelines(
    redis_server, tier_factory, monkeypatch, caplog
):
    monkeypatch.setattr(redis_wire, "_socket_of", lambda conn: None)
    tier = tier_factory(redis_server.url, key_prefix="nosock")
    items = [(name(i), payload(100_000, i)) for i in range(3)]
    assert tier.put_many(items) == [None] * 3
    assert tier.get_many([n for n, _ in items] + [name(9)])[:3] == [p for _, p in items]
    assert isinstance(tier.get_many([name(9)])[0], ChunkMissing)
    assert sum("no socket to read values from" in r.message for r in caplog.records) == 1
