"""Damaged values never load as payloads; passwords work and never show in errors."""

from __future__ import annotations

import pytest

from connector.tiers.base import ChunkCorrupt
from connector.tiers.redis_tier import RemoteUnavailable
from connector.tiers.remote_url import PASSWORD_ENV

from .helpers import name, payload
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
