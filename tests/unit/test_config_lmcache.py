"""LMCache settings start, start with one warning, or are refused for a reason, in KVLens's words."""

from __future__ import annotations

import logging

import pytest

from connector.config.keys import ALIASES, EXTRA_FEATURES, EXTRA_LMCACHE, FEATURES, UNUSED
from connector.config.loading import ConfigError, KVLensConfig, load_config
from connector.config.model import ExtraConfig

SECRET = "Sup3r-s3cret-pw"
PYDANTIC_WORDS = ("Input should", "Extra inputs", "pydantic", "errors.pydantic.dev", "validation error")


def refused(extra=None, env=None, tmp_path=None, yaml_text=None) -> str:
    env = dict(env or {})
    if yaml_text is not None:
        path = tmp_path / "lmcache.yaml"
        path.write_text(yaml_text)
        env["LMCACHE_CONFIG_FILE"] = str(path)
    with pytest.raises(ConfigError) as e:
        load_config(extra or {}, env=env)
    message = str(e.value)
    assert not any(word in message for word in PYDANTIC_WORDS), message
    return message


@pytest.mark.parametrize(
    ("extra", "env", "says"),
    [
        (
            {},
            {"LMCACHE_ENABLE_PD": "True"},
            ["enable_pd = 'True' (from env LMCACHE_ENABLE_PD)", "transfer_channel: tcp"],
        ),
        (
            {"lmcache.enable_xpyd": True},
            {},
            ["enable_xpyd = True", "transfer channel", "transfer_channel: tcp"],
        ),
        ({"lmcache.enable_nixl": True}, {}, ["enable_nixl", "NIXL", "transfer_channel: tcp"]),
        ({}, {"LMCACHE_ENABLE_P2P": "1"}, ["enable_p2p", "P2P sharing", "remote_url: redis://"]),
        ({"lmcache.enable_controller": "true"}, {}, ["enable_controller", "controller"]),
        ({"lmcache.enable_hidden_state_cache": True}, {}, ["enable_hidden_state_cache"]),
        (
            {"lmcache.remote_serde": "cachegen", "lmcache.remote_url": "redis://h"},
            {},
            ["remote_serde = 'cachegen'", "CacheGen", "naive"],
        ),
        (
            {"lmcache.remote_serde": "torch", "lmcache.remote_url": "redis://h"},
            {},
            ["remote_serde = 'torch'", "serializer"],
        ),
        (
            {"lmcache.remote_url": "lm://localhost:65432"},
            {},
            ["remote_url lm://", "LMCache server", "redis://"],
        ),
        ({"lmcache.remote_url": "mooncakestore://127.0.0.1:50051/"}, {}, ["Mooncake"]),
        ({"lmcache.remote_url": "infinistore://127.0.0.1:12345/?device=mlx5_1"}, {}, ["InfiniStore"]),
        ({"lmcache.remote_url": "s3://bucket.s3.us-east-1.amazonaws.com"}, {}, ["S3"]),
        ({"lmcache.remote_url": "fs:///mnt/shared"}, {}, ["local_disk: <path>"]),
        ({}, {"LMCACHE_GDS_PATH": "/mnt/gds"}, ["gds_path = '/mnt/gds' (from env LMCACHE_GDS_PATH)", "GDS"]),
        ({"lmcache.weka_path": "/mnt/weka"}, {}, ["Weka"]),
        ({"lmcache.storage_plugins": ["x"]}, {}, ["storage plugins"]),
        ({"lmcache.external_lookup_client": "mooncakestore://h"}, {}, ["external lookup"]),
        ({"lmcache.cache_policy": "cost_aware"}, {}, ["COST_AWARE", "LRU, LFU, FIFO or MRU"]),
        ({"lmcache.extra_config": {"enable_nixl_storage": True}}, {}, ["extra_config.enable_nixl_storage"]),
    ],
)
def test_a_feature_kvlens_lacks_stops_start_up_naming_setting_source_and_instead(extra, env, says):
    message = refused(extra, env)
    assert "not supported by KVLens" in message and "instead:" in message
    for words in says:
        assert words in message


@pytest.mark.parametrize(
    "extra",
    [
        {"lmcache.enable_pd": False},
        {"lmcache.enable_pd": "false"},
        {"lmcache.enable_p2p": 0},
        {"lmcache.enable_blending": "False"},
        {"lmcache.enable_controller": False},
        {"lmcache.gds_path": None},
        {"lmcache.storage_plugins": []},
        {"lmcache.remote_serde": None},
        {"lmcache.remote_serde": "NAIVE"},
        {"lmcache.extra_config": {"enable_nixl_storage": False}},
    ],
)
def test_the_same_settings_off_are_accepted(extra):
    config = load_config(extra, env={})
    assert config.remote_serde in ("naive", None)


def test_a_serializer_without_a_remote_url_has_no_effect_and_is_accepted_unused():
    config = load_config({"lmcache.remote_serde": "cachegen"}, env={})
    assert config.remote_serde == "naive" and "remote_serde = 'cachegen'" in config.unused_settings[0]


def test_every_problem_is_named_in_one_error():
    message = refused(
        {
            "lmcache.enable_pd": True,
            "lmcache.chunk_sise": 1,
            "lmcache.enable_p2p": True,
            "lmcache.max_local_cpu_size": "x",
            "lmcache.local_cpu": False,
            "lmcache.remote_url": "lm://h:1",
        }
    )
    assert message.count("not supported by KVLens") == 3 and "unknown key 'chunk_sise'" in message
    assert "max_local_cpu_size (from kv_connector_extra_config 'lmcache.max_local_cpu_size')" in message
    assert "no storage tier" not in message  # the refused remote_url was the tier: not a second problem


@pytest.mark.parametrize(
    ("key", "suggestion"),
    [
        ("chunk_sise", "chunk_size"),
        ("async_loading", "enable_async_loading"),
        ("max_local_cpu", "max_local_cpu_size"),
    ],
)
def test_an_unknown_key_is_an_error_with_the_nearest_known_name(key, suggestion):
    message = refused({f"lmcache.{key}": 1})
    assert f"unknown key {key!r}" in message and f"did you mean {suggestion!r}" in message
    assert f"kv_connector_extra_config 'lmcache.{key}'" in message


def test_an_unknown_key_far_from_any_gets_no_guess(tmp_path):
    message = refused(tmp_path=tmp_path, yaml_text="zzqx_wibble: 1\n")
    assert "unknown key 'zzqx_wibble'" in message and "did you mean" not in message
    assert f"LMCACHE_CONFIG_FILE {tmp_path / 'lmcache.yaml'}" in message


def test_lmcache_keys_kvlens_does_not_use_start_with_one_warning(caplog, tmp_path):
    path = tmp_path / "lmcache.yaml"
    path.write_text(
        "chunk_size: 256\nlocal_device: cpu\npipelined_backend: False\nlookup_url: redis://h:1\n"
        "numa_mode: auto\nblocking_timeout_secs: 100\nenable_p2p: false\n"
    )
    with caplog.at_level(logging.WARNING, logger="vllm.kvlens"):
        config = load_config({}, env={"LMCACHE_CONFIG_FILE": str(path)})
    assert len(caplog.records) == 1
    text = caplog.records[0].getMessage()
    for key in (
        "local_device",
        "pipelined_backend",
        "lookup_url",
        "numa_mode",
        "blocking_timeout_secs",
        "enable_p2p",
    ):
        assert key in text and key in " ".join(config.unused_settings)
    assert "extra_config.tier_timeout_s" in text  # what to use instead, where KVLens has one
    assert f"from LMCACHE_CONFIG_FILE {path}" in text


@pytest.mark.parametrize(
    "entry",
    [
        {"use_odirect": True},
        {"lookup_backoff_time": 0.001},
        {"save_only_first_rank": True},
        {"histogram_bucket_time_to_retrieve": [0.1, 1.0]},
        {"p2p_socket_recv_timeout_ms": 30000},
        {"plugin.frontend.port": 7020},
        {"s3_num_io_threads": 64},
        {"some_plugins_own_knob": "x"},
    ],
)
def test_extra_config_is_an_open_mapping_entries_kvlens_does_not_read_warn(entry, caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.kvlens"):
        load_config({"lmcache.extra_config": entry}, env={})
    assert f"extra_config.{next(iter(entry))}" in caplog.text


def test_a_typo_of_a_kvlens_extra_config_entry_is_an_unknown_key():
    message = refused({"lmcache.extra_config": {"remote_key_prefx": "x"}})
    assert "unknown key 'extra_config.remote_key_prefx'" in message
    assert "did you mean 'extra_config.remote_key_prefix'" in message


@pytest.mark.parametrize(
    "name",
    ["LMCACHE_USAGE_TRACK_URL", "LMCACHE_LOG_LEVEL", "LMCACHE_TRACK_USAGE", "LMCACHE_USE_EXPERIMENTAL"],
)
def test_lmcache_process_variables_are_ignored_silently(name, caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.kvlens"):
        config = load_config({}, env={name: "anything at all {["})
    assert config.chunk_size == 256 and caplog.text == ""


@pytest.mark.parametrize(("text", "value"), [("True", True), ("TRUE", True), (" true ", True), ("1", True)])
def test_env_booleans_true_and_1_in_any_case_are_true(text, value):
    assert load_config({}, env={"LMCACHE_SAVE_DECODE_CACHE": text}).save_decode_cache is value


@pytest.mark.parametrize("text", ["yes", "on", "y", "t", "2", "enabled"])
def test_any_other_env_boolean_is_false_as_lmcache_reads_it_and_the_warning_says_so(text, caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.kvlens"):
        config = load_config({}, env={"LMCACHE_SAVE_DECODE_CACHE": text, "LMCACHE_USE_LAYERWISE": "false"})
    assert config.save_decode_cache is False and config.use_layerwise is False
    assert "save_decode_cache" in caplog.text and "read as false" in caplog.text
    assert "use_layerwise" not in caplog.text  # false and 0 need no word


def test_an_env_feature_switch_is_read_as_lmcache_reads_it():
    assert load_config({}, env={"LMCACHE_ENABLE_PD": "yes"}).chunk_size == 256  # LMCache: false
    refused(env={"LMCACHE_ENABLE_PD": "TRUE"})


def test_enable_async_loading_is_honoured_without_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.kvlens"):
        config = load_config({}, env={"LMCACHE_ENABLE_ASYNC_LOADING": "True"})
    assert config.enable_async_loading
    assert "enable_async_loading" not in caplog.text


@pytest.mark.parametrize("name", ["LRU", "lru", "Lfu", "fifo", "MRU"])
def test_cache_policy_in_any_case(name):
    assert load_config({"lmcache.cache_policy": name}, env={}).cache_policy == name.upper()


def test_an_unknown_cache_policy_names_the_choices():
    message = refused({"lmcache.cache_policy": "ARC"})
    assert "cache_policy (from kv_connector_extra_config 'lmcache.cache_policy')" in message
    assert "LRU, LFU, FIFO, MRU" in message


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"lmcache.chunk_size": "big"}, "chunk_size (from {src}) must be a whole number, not 'big'"),
        ({"lmcache.chunk_size": 0}, "chunk_size (from {src}) must be > 0, not 0"),
        ({"lmcache.chunk_size": 2.5}, "chunk_size (from {src}) must be a whole number, not 2.5"),
        ({"lmcache.max_local_cpu_size": "lots"}, "max_local_cpu_size (from {src}) must be a number"),
        (
            {"lmcache.max_local_cpu_size": float("inf")},
            "max_local_cpu_size (from {src}) must be a finite number",
        ),
        ({"lmcache.local_cpu": None}, "local_cpu (from {src}) must be true or false, not None"),
        ({"lmcache.remote_serde": 3}, "remote_serde (from {src}) must be one of 'naive'"),
        ({"lmcache.extra_config": [1, 2]}, "extra_config (from {src}) must be a mapping of keys"),
        (
            {"lmcache.extra_config": {"remote_key_prefix": "a:b"}},
            "extra_config.remote_key_prefix (from {src})",
        ),
        (
            {"lmcache.extra_config": {"remote_ttl_s": -1}},
            "extra_config.remote_ttl_s (from {src}) must be > 0",
        ),
        ({"lmcache.extra_config": {"tag_keys": [1]}}, "extra_config.tag_keys (from {src}) must be a list"),
        ({"lmcache.extra_config": {"valkey_mode": "sharded"}}, "'standalone' or 'cluster', not 'sharded'"),
        (
            {"lmcache.extra_config": {"block_granular_tails": "perhaps"}},
            "must be true or false, not 'perhaps'",
        ),
        ({"lmcache.priority_limit": "high"}, "priority_limit (from {src}) must be a whole number"),
        ({"lmcache.local_cpu": False}, "no storage tier: set local_cpu: true, local_disk or remote_url"),
        ({"lmcache.local_disk": "/x"}, "max_local_disk_size must be > 0 when local_disk is set"),
        ({"lmcache.remote_url": "memcache://h:1"}, "remote_url (from {src}): remote_url scheme 'memcache'"),
        ({"lmcache.remote_url": "redis://h:99999"}, "port '99999' of 'h' is not a number from 1 to 65535"),
    ],
)
def test_invalid_values_are_kvlens_sentences_naming_key_and_source(extra, says):
    source = f"kv_connector_extra_config {next(iter(extra))!r}"
    assert says.format(src=source) in refused(extra)


def test_tag_keys_from_lmcache_examples():
    config = load_config({"lmcache.extra_config": {"tag_keys": ["user", "tenant"]}}, env={})
    assert config.extra_config.tag_keys == ("user", "tenant")


def test_valkey_credentials_and_database_come_from_extra_config_and_never_show():
    config = load_config(
        {
            "lmcache.remote_url": "valkey://cache.local:6379",
            "lmcache.extra_config": {
                "valkey_username": "svc",
                "valkey_password": SECRET,
                "valkey_database": 3,
            },
        },
        env={},
    )
    remote = config.remote
    assert (remote.username, remote.password, remote.db, remote.cluster) == ("svc", SECRET, 3, False)
    for shown in (str(config.summary()), repr(config), repr(remote), str(remote), str(config.extra_config)):
        assert SECRET not in shown


def test_valkey_cluster_mode_reads_the_node_list_in_any_case():
    config = load_config(
        {
            "lmcache.remote_url": "valkey://n1:7000, n2:7001, n3:7002",
            "lmcache.extra_config": {"valkey_mode": "CLUSTER", "valkey_password": SECRET},
        },
        env={},
    )
    assert config.remote.cluster and len(config.remote.nodes) == 3 and config.remote.password == SECRET


def test_several_valkey_nodes_without_cluster_mode_are_refused_with_what_to_set():
    message = refused({"lmcache.remote_url": "valkey://n1:7000,n2:7001"})
    assert "valkey_mode: cluster" in message


def test_valkey_settings_with_a_redis_url_are_accepted_unused(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.kvlens"):
        config = load_config(
            {"lmcache.remote_url": "redis://h", "lmcache.extra_config": {"valkey_password": SECRET}}, env={}
        )
    assert config.remote.password is None
    assert "extra_config.valkey_password" in caplog.text and SECRET not in caplog.text


def test_resp_url_takes_lmcache_resp_credentials():
    config = load_config(
        {
            "lmcache.remote_url": "resp://h:6379",
            "lmcache.extra_config": {"username": "default", "password": SECRET},
        },
        env={},
    )
    assert (config.remote.username, config.remote.password) == ("default", SECRET)
    assert SECRET not in str(config.summary())


def test_passwords_never_appear_in_errors_or_warnings(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.kvlens"):
        message = refused(
            {
                "lmcache.remote_url": f"redis://:{SECRET}@h:1/x",
                "lmcache.extra_config": {"valkey_password": 5, "password": [SECRET]},
            }
        )
        message += refused({"lmcache.extra_config": {"valkey_password": {"a": SECRET}}, "lmcache.nope": 1})
    assert SECRET not in message and SECRET not in caplog.text


def test_sentinel_url_in_config_takes_the_service_name_lmcache_reads_from_the_environment():
    url = "redis-sentinel://s1:26379,s2:26379,s3:26379"
    assert load_config(
        {"lmcache.remote_url": url}, env={"REDIS_SERVICE_NAME": "mymaster"}
    ).remote.service_name == ("mymaster")
    assert load_config({"lmcache.remote_url": url}, env={}).remote.service_name == "redismaster"
    assert load_config({"lmcache.remote_url": url + "/cache"}, env={}).remote.service_name == "cache"


def test_unix_socket_and_query_options_in_config():
    config = load_config({"lmcache.remote_url": "unix:///run/redis.sock?db=2&socket_timeout=0.5"}, env={})
    assert config.remote.socket_path == "/run/redis.sock" and config.remote.db == 2
    assert config.extra_config.remote_timeout_s == 0.5  # the URL's timeout is KVLens's data-call timeout


def test_url_timeout_and_remote_timeout_s_must_agree():
    message = refused(
        {"lmcache.remote_url": "redis://h?socket_timeout=1", "lmcache.extra_config": {"remote_timeout_s": 3}}
    )
    assert "remote_timeout_s" in message
    same = {
        "lmcache.remote_url": "redis://h?socket_timeout=3",
        "lmcache.extra_config": {"remote_timeout_s": 3},
    }
    assert load_config(same, env={}).extra_config.remote_timeout_s == 3


def test_url_retry_options_are_accepted_and_said_unused(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.kvlens"):
        load_config({"lmcache.remote_url": "redis://h?retry_on_timeout=true"}, env={})
    assert "retry_on_timeout" in caplog.text and "does not retry" in caplog.text


def test_lmcache_vllm_level_keys_are_accepted(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.kvlens"):
        config = load_config({"discard_partial_chunks": False, "lmcache_rpc_port": "producer1"}, env={})
    assert not config.discard_partial_chunks and "lmcache_rpc_port" in caplog.text


def test_extra_config_in_lmcache_docs_python_literal_style_parses():
    env = {"LMCACHE_EXTRA_CONFIG": "{'use_odirect': True}"}  # as LMCache's local-storage page writes it
    load_config({}, env=env)
    env = {"LMCACHE_EXTRA_CONFIG": '{"lookup_backoff_time": 0.01, "use_odirect": True}'}  # its CI config
    load_config({}, env=env)


def test_the_catalogue_gives_each_key_one_meaning():
    fields = set(KVLensConfig.model_fields)
    assert not fields & set(UNUSED) and not fields & set(FEATURES) and not set(UNUSED) & set(FEATURES)
    assert all(name in UNUSED or name in FEATURES for name in ALIASES.values())
    extra_fields = set(ExtraConfig.model_fields)
    assert not extra_fields & set(EXTRA_LMCACHE) and not extra_fields & set(EXTRA_FEATURES)


def test_lmcache_ec_overrides_are_not_taken_for_typos(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.kvlens"):
        load_config({}, env={"LMCACHE_EC_CHUNK_SIZE": "128", "LMCACHE_EC_LOCAL_CPU": "true"})
    assert caplog.text == ""
