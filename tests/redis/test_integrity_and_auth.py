"""Damaged values never load as payloads; passwords work and never show in errors; with a store
key only records its holders wrote load; no length a value announces is allocated beyond a chunk."""

from __future__ import annotations

import tracemalloc

import pytest

from connector.tiers.base import ChunkCorrupt
from connector.tiers.record_trust import MAX_HEADER_BYTES, RecordTrust
from connector.tiers.redis_tier import RemoteUnavailable
from connector.tiers.remote_url import PASSWORD_ENV

from .helpers import name, payload
from .proxy import Relay
from .servers import OPENSSL, make_certificates

SECRET = "pw-Xq7-very-secret"


@pytest.mark.parametrize(
    "damage",
    ["flip_payload", "flip_header", "truncate", "other_name", "junk", "empty", "not_a_string"],
)
def test_damaged_value_is_chunk_corrupt_never_a_payload(redis_server, tier_factory, damage):
    tier = tier_factory(redis_server.url, key_prefix="dmg")
    data = payload(64 * 1024, 3)
    size = tier.put(name(1), data)
    tier.put(name(2), payload(64 * 1024, 4))
    key = tier.key(name(1))
    with redis_server.client() as raw:
        if damage == "flip_payload":
            raw.setrange(key, size - 1000, b"\x01\x02\x03")
        elif damage == "flip_header":
            raw.setrange(key, 20, b"~")
        elif damage == "truncate":
            raw.set(key, raw.get(key)[: size - 10])
        elif damage == "other_name":  # a whole, valid record, but written for another chunk
            raw.copy(tier.key(name(2)), key, replace=True)
        elif damage == "junk":
            raw.set(key, b"hello, not a chunk")
        elif damage == "empty":
            raw.set(key, b"")
        else:
            raw.delete(key)
            raw.rpush(key, b"a list lives here")
    with pytest.raises(ChunkCorrupt):
        tier.get(name(1))
    (got,) = tier.get_many([name(1)])
    assert isinstance(got, ChunkCorrupt)


def test_record_written_for_another_kv_layout_is_corrupt(redis_server, tier_factory):
    tier_factory(redis_server.url, key_prefix="lay", layout="layout-A").put(name(1), payload(1000))
    other = tier_factory(redis_server.url, key_prefix="lay", layout="layout-B")
    assert other.exists_many([name(1)]) == [True]  # existence says nothing about validity
    with pytest.raises(ChunkCorrupt):
        other.get(name(1))


@pytest.fixture
def locked(server_factory):
    return server_factory(password=SECRET)


def test_password_from_url_works(locked, tier_factory):
    tier = tier_factory(f"redis://:{SECRET}@127.0.0.1:{locked.port}/0")
    tier.put(name(1), payload(2000))
    assert tier.get(name(1)) == payload(2000)
    assert SECRET not in repr(tier)


def test_password_from_environment_works(locked, tier_factory):
    tier = tier_factory(f"redis://127.0.0.1:{locked.port}/0", environ={PASSWORD_ENV: SECRET})
    tier.put(name(1), payload(2000))
    assert tier.exists_many([name(1)]) == [True]


def test_acl_user_and_password_from_url_work(locked, tier_factory):
    with locked.client() as raw:
        raw.acl_setuser("kvuser", enabled=True, passwords=["+" + SECRET], keys=["acl:*"], commands=["+@all"])
    tier = tier_factory(f"redis://kvuser:{SECRET}@127.0.0.1:{locked.port}/0", key_prefix="acl")
    tier.put(name(1), payload(2000))
    assert tier.get(name(1)) == payload(2000)
    outside = tier_factory(f"redis://kvuser:{SECRET}@127.0.0.1:{locked.port}/0", key_prefix="other")
    with pytest.raises(RemoteUnavailable) as info:  # NOPERM: the ACL keeps this user to acl:*
        outside.put(name(1), payload(10))
    assert info.value.kind == "auth" and SECRET not in str(info.value)


@pytest.mark.parametrize("given", ["wrong-" + SECRET, None])
def test_wrong_or_missing_password_is_remote_unavailable_without_the_password(locked, tier_factory, given):
    url = (
        f"redis://127.0.0.1:{locked.port}/0"
        if given is None
        else f"redis://:{given}@127.0.0.1:{locked.port}/0"
    )
    tier = tier_factory(url)
    calls = [
        lambda: tier.put(name(1), payload(10)),
        lambda: tier.get(name(1)),
        lambda: tier.exists_many([name(1)]),
        tier.ping,
    ]
    for call in calls:
        with pytest.raises(RemoteUnavailable) as info:
            call()
        assert info.value.kind == "auth", info.value
        for shown in (str(info.value), repr(info.value), str(info.value.args)):
            assert SECRET not in shown
        assert str(locked.port) in str(info.value)  # says where, redacted
    (item,) = tier.get_many([name(1)])
    assert isinstance(item, RemoteUnavailable) and SECRET not in str(item)


@pytest.fixture
def tls_server(tmp_path, server_factory):
    if not OPENSSL:
        pytest.skip("openssl is not installed")
    certs = make_certificates(tmp_path / "certs")
    return server_factory(tls=certs), certs


def test_tls_url_with_the_servers_ca_round_trips(tls_server, tier_factory):
    server, certs = tls_server
    tier = tier_factory(f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={certs / 'ca.pem'}")
    tier.put(name(1), payload(300_000))
    assert tier.get(name(1)) == payload(300_000)
    assert tier.exists_many([name(1), name(2)]) == [True, False]


def test_tls_server_not_trusted_or_not_spoken_is_remote_unavailable(tls_server, tier_factory):
    server, _ = tls_server
    untrusted = tier_factory(f"rediss://127.0.0.1:{server.port}/0")  # system CAs only
    with pytest.raises(RemoteUnavailable) as info:
        untrusted.get(name(1))
    assert info.value.kind == "connection"
    plain = tier_factory(f"redis://127.0.0.1:{server.port}/0", timeout_s=0.5)
    with pytest.raises(RemoteUnavailable):
        plain.get(name(1))


# ---- what the store may announce, and who may have written it (extra_config.store_auth_key) ----

MAX_PAYLOAD = 64 * 1024  # the largest chunk of the layout these tiers are told they store
STORE_KEY = "a-store-key-of-the-fleet-0001"


class Allocations:
    """Sizes asked of a tier's read buffers; one far over a chunk is refused (never allocated)."""

    def __init__(self, take):
        self.asked: list[int] = []
        self._take = take

    def __call__(self, nbytes: int):
        self.asked.append(nbytes)
        if nbytes > 64 * MAX_PAYLOAD:
            raise MemoryError(f"test refuses to allocate {nbytes} bytes")
        return self._take(nbytes)


def _bounded(tier_factory, url: str, key: str | None = None, **kwargs):
    tier = tier_factory(url, trust=RecordTrust.of(key, MAX_PAYLOAD), **kwargs)
    allocations = Allocations(tier.read_buffers.take)
    tier.read_buffers.take = allocations  # type: ignore[method-assign]
    return tier, allocations


def test_a_value_longer_than_any_record_is_read_past_not_into_memory(redis_server, tier_factory):
    tier, allocations = _bounded(tier_factory, redis_server.url, key_prefix="big")
    tier.put(name(2), payload(MAX_PAYLOAD, 2))
    with redis_server.client() as raw:  # planted by anyone who can write the prefix
        raw.set(tier.key(name(1)), b"x" * (40 * MAX_PAYLOAD))
    tracemalloc.start()
    try:
        first, second = tier.get_many([name(1), name(2)])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(first, ChunkCorrupt) and "larger than any" in str(first)
    assert bytes(second) == bytes(payload(MAX_PAYLOAD, 2))  # the connection stayed in step
    assert max(allocations.asked) <= MAX_PAYLOAD + MAX_HEADER_BYTES + 2, allocations.asked
    assert peak < 8 * MAX_PAYLOAD


class LyingRelay(Relay):
    """Relays a real server, but says every value of ``size`` bytes is ``claimed`` bytes long."""

    def __init__(self, port: int, size: int, claimed: int) -> None:
        super().__init__(port)
        self._said, self._lie = b"$%d\r\n" % size, b"$%d\r\n" % claimed

    def _allowed(self, data: bytes, dst) -> bytes:
        return data.replace(self._said, self._lie)


def test_a_reply_announcing_a_terabyte_is_refused_without_allocating(redis_server, tier_factory):
    writer = tier_factory(redis_server.url, key_prefix="tb")
    record_bytes = writer.put(name(1), payload(1000, 1))
    relay = LyingRelay(redis_server.port, record_bytes, 2**40)
    try:
        tier, allocations = _bounded(tier_factory, relay.url, key_prefix="tb")
        tracemalloc.start()
        try:
            (got,) = tier.get_many([name(1)])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    finally:
        relay.close()
    assert isinstance(got, (ChunkCorrupt, RemoteUnavailable)), got
    assert max(allocations.asked, default=0) <= MAX_PAYLOAD + MAX_HEADER_BYTES + 2, allocations.asked
    assert peak < 8 * MAX_PAYLOAD


@pytest.mark.parametrize("writer_key", [None, "another-fleets-key-0002"])
def test_with_a_store_key_a_record_planted_without_it_is_refused(redis_server, tier_factory, writer_key):
    prefix = "plant" + ("k" if writer_key else "n")
    tier_factory(redis_server.url, key_prefix=prefix, trust=RecordTrust.of(writer_key)).put(
        name(1), payload(2000, 1)
    )
    reader = tier_factory(redis_server.url, key_prefix=prefix, trust=RecordTrust.of(STORE_KEY, MAX_PAYLOAD))
    with pytest.raises(ChunkCorrupt, match="store_auth_key"):
        reader.get(name(1))
    (got,) = reader.get_many([name(1)])
    assert isinstance(got, ChunkCorrupt)


def test_with_the_right_key_records_load_and_a_reader_without_a_key_loads_them_too(
    redis_server, tier_factory
):
    writer = tier_factory(redis_server.url, key_prefix="right", trust=RecordTrust.of(STORE_KEY, MAX_PAYLOAD))
    writer.put(name(1), payload(2000, 1))
    writer.put_many([(name(2), payload(3000, 2))])
    plain = tier_factory(redis_server.url, key_prefix="right")
    for reader in (writer, plain):
        assert [bytes(v) for v in reader.get_many([name(1), name(2)])] == [
            bytes(payload(2000, 1)),
            bytes(payload(3000, 2)),
        ]


def test_a_tagged_record_copied_under_another_chunks_name_is_refused(redis_server, tier_factory):
    trust = RecordTrust.of(STORE_KEY, MAX_PAYLOAD)
    writer = tier_factory(redis_server.url, key_prefix="copy", trust=trust)
    writer.put(name(2), payload(2000, 2))
    with redis_server.client() as raw:  # B's record under A's key, its name field made A's
        record = raw.get(writer.key(name(2)))
        raw.set(writer.key(name(1)), record.replace(name(2).encode(), name(1).encode()))
    assert bytes(tier_factory(redis_server.url, key_prefix="copy").get(name(1))) == bytes(
        payload(2000, 2)
    )  # without a key, anyone who can write the prefix steers what loads
    with pytest.raises(ChunkCorrupt, match="store_auth_key"):
        writer.get(name(1))
