"""PD settings (issue 28 item 1): LMCache's pd_* keys from YAML, LMCACHE_* variables and
kv_connector_extra_config; transfer_channel tcp is KVLens's, other channels are refused naming tcp;
combinations KVLens cannot honour stop start-up naming both keys."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from connector.config.loading import ConfigError, load_config
from connector.config.pd import PDConfig, check_for_engine

# LMCache's 1p1d example configurations (examples/disagg_prefill/1p1d/configs/ and the older
# examples/disagg_prefill/configs/), as they are, with transfer_channel: tcp.
EXAMPLES = {
    "prefiller": """\
local_cpu: False
save_unfull_chunk: true  # Don't discard partial chunks (< 256 tokens)

enable_pd: True
transfer_channel: "tcp"
pd_role: "sender"
pd_proxy_host: "localhost"
pd_proxy_port: 7500
pd_buffer_size: 1073741824 # 1GB
pd_buffer_device: "cuda"
nixl_backends: [UCX]""",
    "decoder": """\
local_cpu: False

# PD-related configurations
enable_pd: True
transfer_channel: "tcp"
pd_role: "receiver"
pd_peer_host: "localhost"
pd_peer_init_port: 7300
pd_peer_alloc_port: 7400
pd_buffer_size: 1073741824  # 1GB buffer for KV cache transfer
pd_buffer_device: "cuda"
nixl_backends: [UCX]
""",
    "old_prefiller": """\
local_cpu: False
max_local_cpu_size: 0
max_local_disk_size: 0
remote_serde: NULL

enable_nixl: True
transfer_channel: tcp
nixl_role: "sender"
nixl_peer_host: "localhost"
nixl_peer_port: 55555
nixl_buffer_size: 1073741824 # 1GB
nixl_buffer_device: "cuda"
nixl_enable_gc: True
""",
    "old_decoder": """\
local_cpu: False
max_local_cpu_size: 0
max_local_disk_size: 0
remote_serde: NULL

enable_nixl: True
transfer_channel: tcp
nixl_role: "receiver"
nixl_peer_host: "localhost"
nixl_peer_port: 55555
nixl_buffer_size: 1073741824 # 1GB
nixl_buffer_device: "cuda"
nixl_enable_gc: True
""",
}


def from_yaml(tmp_path, text, extra=None, env=None):
    path = tmp_path / "lmcache.yaml"
    path.write_text(text)
    return load_config(extra or {}, env={"LMCACHE_CONFIG_FILE": str(path), **(env or {})})


def refused(tmp_path, text, extra=None, env=None) -> str:
    with pytest.raises(ConfigError) as e:
        from_yaml(tmp_path, text, extra, env)
    message = str(e.value)
    assert "Input should" not in message and "Extra inputs" not in message
    return message


@pytest.mark.parametrize("case", sorted(EXAMPLES))
def test_lmcache_1p1d_example_configs_with_tcp_start_as_they_are(case, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.kvlens"):
        config = from_yaml(tmp_path, EXAMPLES[case])
    pd = config.pd
    assert pd.enabled and config.tier_names() == ()  # local_cpu: False: the PD buffer is all there is
    assert pd.buffer_size == 1073741824
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "unknown key" not in warnings[0].getMessage()
    assert "pd_buffer_device = 'cuda'" in warnings[0].getMessage()  # said, not refused
    if case.endswith("prefiller"):
        assert pd.sender and not pd.receiver and pd.peer_init_ports == ()
    else:
        assert pd.receiver and pd.peer_host == "localhost"
    if case == "prefiller":
        assert (pd.proxy_host, pd.proxy_port, pd.notifies_proxy) == ("localhost", 7500, True)
    if case == "decoder":
        assert (pd.peer_init_ports, pd.peer_alloc_ports) == ((7300,), (7400,))
    if case == "old_decoder":  # the single-port form: alloc = init + 100, said in the warning
        assert (pd.peer_init_ports, pd.peer_alloc_ports) == ((55555,), (55655,))
        assert "pd_peer_init_port + 100" in warnings[0].getMessage()
    if case == "old_prefiller":  # no proxy configured: nobody to notify, and the warning says so
        assert not pd.notifies_proxy and "no proxy is notified" in warnings[0].getMessage()


@pytest.mark.parametrize("channel", ["nixl", "mooncake", "NIXL"])
def test_a_channel_kvlens_lacks_is_refused_naming_tcp(channel, tmp_path):
    text = EXAMPLES["decoder"].replace('transfer_channel: "tcp"', f"transfer_channel: {channel}")
    message = refused(tmp_path, text)
    assert f"transfer_channel = '{channel}'" in message and "not supported by KVLens" in message
    assert "instead: transfer_channel: tcp" in message


def test_pd_without_a_channel_is_refused_naming_tcp(tmp_path):
    message = refused(tmp_path, EXAMPLES["decoder"].replace('transfer_channel: "tcp"', ""))
    assert "no transfer_channel" in message and "transfer_channel: tcp" in message


def test_pd_keys_from_env_and_extra_config_with_lmcache_precedence(tmp_path):
    env = {
        "LMCACHE_ENABLE_PD": "True",
        "LMCACHE_TRANSFER_CHANNEL": "tcp",
        "LMCACHE_PD_ROLE": "receiver",
        "LMCACHE_PD_PEER_HOST": "127.0.0.1",
        "LMCACHE_PD_PEER_INIT_PORT": "[7300, 7301]",
        "LMCACHE_PD_PEER_ALLOC_PORT": "7400,7401",
        "LMCACHE_PD_BUFFER_SIZE": "1048576",
        "LMCACHE_PD_BUFFER_DEVICE": "cpu",
        "LMCACHE_PD_UNCLAIMED_TIMEOUT_SEC": "5",
    }
    extra = {"lmcache.pd_buffer_size": 2097152, "lmcache.pd_transfer_timeout_sec": 2.5}
    pd = load_config(extra, env=env).pd
    assert pd.receiver and pd.peer_init_ports == (7300, 7301) and pd.peer_alloc_ports == (7400, 7401)
    assert pd.buffer_size == 2097152  # kv_connector_extra_config wins over the environment
    assert (pd.unclaimed_timeout_s, pd.transfer_timeout_s) == (5.0, 2.5)


def test_pd_off_leaves_pd_keys_accepted_unused(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.kvlens"):
        config = load_config({"lmcache.pd_role": "sender", "lmcache.pd_buffer_size": 10}, env={})
    assert not config.pd.enabled and config.tier_names() == ("cpu",)
    assert "pd_role" in caplog.text and "enable_pd is off" in caplog.text


def test_pd_off_still_needs_a_tier(tmp_path):
    assert "no storage tier" in refused(tmp_path, "local_cpu: false\n")


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (("pd_peer_init_port: 7300", ""), "pd_role receiver needs pd_peer_init_port"),
        (('pd_peer_host: "localhost"', ""), "pd_role receiver needs pd_peer_host"),
        (("pd_peer_alloc_port: 7400", "pd_peer_alloc_port: [7400, 7401]"), "must list one port per TP rank"),
        (("pd_peer_alloc_port: 7400", "pd_peer_alloc_port: 7300"), "must not repeat a port"),
        (('pd_role: "receiver"', 'pd_role: "both"'), "needs pd_role: sender (a prefiller) or receiver"),
        (("pd_buffer_size: 1073741824", "pd_buffer_size: -1"), "pd_buffer_size"),
        (("pd_buffer_size: 1073741824", ""), "needs pd_buffer_size"),
        (('pd_buffer_device: "cuda"', "pd_buffer_device: tpu"), "must be cpu or cuda"),
        (("pd_peer_init_port: 7300", "pd_peer_init_port: 70000"), "a port or a list of ports"),
        (("nixl_backends: [UCX]", "pd_bidirectional: true"), "pd_bidirectional = True"),
        (("nixl_backends: [UCX]", "pd_backend_mode: turbo"), "must be sync or async"),
    ],
)
def test_pd_settings_lmcache_forbids_are_refused_at_start_up(change, says, tmp_path):
    text = EXAMPLES["decoder"].replace(*change)
    assert text != EXAMPLES["decoder"]
    assert says in refused(tmp_path, text)


def test_legacy_lmcache_keys_and_ec_overrides_get_one_warning_not_unknown_key(tmp_path, caplog):
    text = "chunk_size: 256\nuse_experimental: True\nerror_handling: False\nec_max_local_cpu_size: 2\n"
    with caplog.at_level(logging.WARNING, logger="vllm.kvlens"):
        config = from_yaml(tmp_path, text)
    assert config.chunk_size == 256
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    for key in ("use_experimental", "error_handling", "ec_max_local_cpu_size"):
        assert key in warnings[0]
    assert "encoder cache" in warnings[0]


def test_an_ec_key_that_is_no_lmcache_key_is_still_unknown(tmp_path):
    assert "unknown key 'ec_nonsense'" in refused(tmp_path, "ec_nonsense: 1\n")


SENDER = PDConfig(enabled=True, role="sender", buffer_size=1 << 20)
RECEIVER = PDConfig(
    enabled=True,
    role="receiver",
    buffer_size=1 << 20,
    peer_host="h",
    peer_init_ports=(1,),
    peer_alloc_ports=(2,),
)


@pytest.mark.parametrize(
    ("pd", "kv_role", "tp", "chunk_bytes", "says"),
    [
        (SENDER, "kv_consumer", 1, 1000, "pd_role sender with kv_role kv_consumer"),
        (RECEIVER, "kv_producer", 1, 1000, "pd_role receiver with kv_role kv_producer"),
        (
            RECEIVER,
            "kv_consumer",
            2,
            1000,
            "pd_peer_init_port lists 1 port(s) and the tensor-parallel size is 2",
        ),
        (RECEIVER, "kv_consumer", 1, (1 << 20) + 1, "pd_buffer_size 1048576 bytes is smaller than one chunk"),
        (
            replace(RECEIVER, max_prefill_len=4096),
            "kv_consumer",
            1,
            1 << 19,
            "fewer than pd_max_prefill_len 4096",
        ),
    ],
)
def test_engine_checks_name_both_settings(pd, kv_role, tp, chunk_bytes, says):
    problems = check_for_engine(pd, kv_role, tp, 256, chunk_bytes)
    assert any(says in p for p in problems), problems


@pytest.mark.parametrize("pd", [SENDER, RECEIVER])
def test_engine_checks_pass_a_matching_engine(pd):
    role = "kv_producer" if pd.sender else "kv_consumer"
    assert check_for_engine(pd, role, 1, 256, 1000) == []
    assert (check_for_engine(pd, "kv_both", 1, 256, 1000) == []) is pd.sender
