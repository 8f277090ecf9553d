"""Whom PD trusts, as configured: a key from pd_auth_key, its file or the deployment's
store_auth_key; a decoder without a key binds loopback only, a prefiller without a key sends to
loopback only, and anything else stops start-up naming the settings unless the operator wrote
pd_allow_unauthenticated: true; where a prefiller may send (pd_allowed_receivers); TLS files."""

from __future__ import annotations

import logging

import pytest

from connector.config.loading import ConfigError
from connector.config.pd_trust import admits, beyond_loopback, is_loopback, parse_entry, parse_list

from .test_pd_config import EXAMPLES, from_yaml

KEY = "a PD key of 32 characters, or so"


def _decoder(tmp_path, host="localhost", **extra):  # type: ignore[no-untyped-def]
    text = EXAMPLES["decoder"].replace('pd_peer_host: "localhost"', f'pd_peer_host: "{host}"')
    return from_yaml(tmp_path, text, extra={f"lmcache.{k}": v for k, v in extra.items()})


def _prefiller(tmp_path, **extra):  # type: ignore[no-untyped-def]
    return from_yaml(tmp_path, EXAMPLES["prefiller"], extra={f"lmcache.{k}": v for k, v in extra.items()})


def test_lmcaches_one_host_examples_start_without_a_key(tmp_path):
    decoder, prefiller = _decoder(tmp_path).pd, _prefiller(tmp_path).pd
    assert decoder.receiver and prefiller.sender
    assert decoder.auth_key is None and prefiller.auth_key is None


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.7", "::", "fd00::7"])
def test_a_decoder_beyond_loopback_without_a_key_stops_start_up_naming_the_settings(tmp_path, host):
    with pytest.raises(ConfigError) as e:
        _decoder(tmp_path, host)
    text = str(e.value)
    for name in (
        "pd_peer_host",
        "pd_auth_key",
        "pd_auth_key_file",
        "store_auth_key",
        "pd_allow_unauthenticated",
    ):
        assert name in text
    assert KEY not in text


def test_a_decoder_beyond_loopback_starts_with_a_key_and_the_key_is_never_shown(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    config = _decoder(tmp_path, "0.0.0.0", pd_auth_key=KEY)
    assert config.pd.auth_key == KEY.encode() and config.pd.auth_source == "pd_auth_key"
    assert KEY not in repr(config.pd) and KEY not in str(config.summary())
    assert KEY not in caplog.text


def test_the_key_comes_from_its_file_or_from_store_auth_key_alone(tmp_path):
    path = tmp_path / "pd.key"
    path.write_text(KEY + "\n")
    from_file = _decoder(tmp_path, "0.0.0.0", pd_auth_key_file=str(path))
    assert from_file.pd.auth_key == KEY.encode() and from_file.pd.auth_source == "pd_auth_key_file"
    store = _decoder(
        tmp_path, "0.0.0.0", **{"extra_config": {"store_auth_key": "the store's key, long enough"}}
    )
    assert store.pd.auth_key == b"the store's key, long enough" and store.pd.auth_source == "store_auth_key"
    own = _decoder(
        tmp_path, "0.0.0.0", pd_auth_key=KEY, extra_config={"store_auth_key": "the store's key, long"}
    )
    assert own.pd.auth_key == KEY.encode()  # PD's own key wins


@pytest.mark.parametrize(
    "extra, says",
    [
        ({"pd_auth_key": "short"}, "at least 16"),
        ({"pd_auth_key": KEY, "pd_auth_key_file": "/x"}, "not both"),
        ({"pd_auth_key_file": "/nonexistent/pd.key"}, "cannot be read"),
    ],
)
def test_a_bad_key_setting_stops_start_up(tmp_path, extra, says):
    with pytest.raises(ConfigError, match=says):
        _decoder(tmp_path, "0.0.0.0", **extra)


def test_pd_allow_unauthenticated_is_the_operators_written_choice_and_is_logged(tmp_path, caplog):
    config = _decoder(tmp_path, "0.0.0.0", pd_allow_unauthenticated=True)
    assert config.pd.allow_unauthenticated and config.pd.auth_key is None
    assert "pd_allow_unauthenticated" in caplog.text


def test_a_prefiller_allowed_beyond_loopback_needs_a_key(tmp_path):
    with pytest.raises(ConfigError, match="pd_allowed_receivers"):
        _prefiller(tmp_path, pd_allowed_receivers=["10.0.0.7:7300"])
    keyed = _prefiller(tmp_path, pd_allowed_receivers="10.0.0.7:7300, decoder-2", pd_auth_key=KEY)
    assert keyed.pd.allowed_receivers == ("10.0.0.7:7300", "decoder-2")
    loopback_only = _prefiller(tmp_path, pd_allowed_receivers=["127.0.0.2", "[::1]:7300"])
    assert loopback_only.pd.auth_key is None


def test_a_bad_receiver_entry_is_named(tmp_path):
    with pytest.raises(ConfigError, match="not_a host!"):
        _prefiller(tmp_path, pd_allowed_receivers=["not_a host!"], pd_auth_key=KEY)


@pytest.mark.parametrize(
    "host, ports, allowed",
    [
        ("127.0.0.1", (7300,), True),
        ("127.9.9.9", (1,), True),
        ("::1", (7300,), True),
        ("localhost", (7300, 7301), True),
        ("LOCALHOST.", (7300,), True),
        ("10.0.0.7", (7300,), True),
        ("10.0.0.7", (7301,), False),  # listed with its port only
        ("10.0.1.5", (9,), True),  # in the listed network
        ("10.0.2.5", (9,), False),
        ("169.254.169.254", (80,), False),  # a metadata service
        ("192.168.1.1", (7300,), False),
        ("::ffff:10.0.1.5", (9,), True),  # the same address, mapped
        ("decoder-2", (7300,), True),
        ("decoder-2.internal", (7300,), False),  # names match as written, never resolved
        ("metadata.google.internal", (80,), False),
        ("fd00::7", (7300,), True),
        ("fd00::8", (7300,), False),
        ("127.0.0.1", (), False),
    ],
)
def test_what_a_prefiller_may_send_to(host, ports, allowed):
    entries = parse_list(("10.0.0.7:7300", "10.0.1.0/24", "decoder-2", "[fd00::7]:7300"))
    assert admits(entries, host, ports) is allowed


def test_loopback_entries_need_no_key_and_others_do():
    assert beyond_loopback(("127.0.0.2", "::1", "localhost", "127.0.0.0/8")) == []
    assert beyond_loopback(("10.0.0.0/8", "0.0.0.0/0", "decoder")) == ["10.0.0.0/8", "0.0.0.0/0", "decoder"]
    assert is_loopback("localhost") and is_loopback("127.0.0.1") and not is_loopback("0.0.0.0")
    with pytest.raises(ValueError):
        parse_entry("10.0.0.7:99999")


def test_tls_files_that_cannot_be_read_stop_start_up(tmp_path):
    with pytest.raises(ConfigError, match="pd_tls_cert_file"):
        _decoder(tmp_path, pd_tls=True, pd_tls_cert_file="/nonexistent.pem")
    with pytest.raises(ConfigError, match="needs pd_tls_cert_file"):
        _decoder(tmp_path, pd_tls=True)
