import pytest

from connector.config.loading import ConfigError, load_config


def test_defaults_match_lmcache():
    c = load_config({}, env={})
    assert c.chunk_size == 256 and c.local_cpu and c.max_local_cpu_size == 5.0
    assert c.local_disk is None and not c.save_unfull_chunk and not c.save_decode_cache
    assert c.extra_config.enable_cache_usage_details_in_response


def test_precedence_yaml_then_env_then_extra_config(tmp_path):
    f = tmp_path / "lmcache.yaml"
    f.write_text("chunk_size: 512\nmin_retrieve_tokens: 10\nsave_decode_cache: true\n")
    env = {"LMCACHE_CONFIG_FILE": str(f), "LMCACHE_MIN_RETRIEVE_TOKENS": "20", "LMCACHE_CHUNK_SIZE": "1024"}
    c = load_config({"lmcache.chunk_size": 128}, env=env)
    assert c.chunk_size == 128  # extra config beats env beats yaml
    assert c.min_retrieve_tokens == 20  # env beats yaml
    assert c.save_decode_cache is True  # yaml beats default


def test_extra_config_dict_merges_across_levels():
    c = load_config(
        {"lmcache.extra_config": {"enable_cache_usage_details_in_response": False}},
        env={"LMCACHE_EXTRA_CONFIG": '{"disk_scan_interval_s": 5}'},
    )
    assert not c.extra_config.enable_cache_usage_details_in_response
    assert c.extra_config.disk_scan_interval_s == 5


@pytest.mark.parametrize(
    "extra,env,key",
    [
        ({"lmcache.chunk_sise": 256}, {}, "chunk_sise"),
        ({"lmcache.chunk_size": "big"}, {}, "chunk_size"),
        ({"lmcache.chunk_size": 0}, {}, "chunk_size"),
        ({}, {"LMCACHE_MAX_LOCAL_CPU_SIZE": "-1"}, "max_local_cpu_size"),
        ({"lmcache.local_disk": "/tmp/x"}, {}, "max_local_disk_size"),
        ({"lmcache.local_cpu": False}, {}, "local_disk"),
        ({"lmcache.extra_config": {"remote_key_prefx": "x"}}, {}, "extra_config.remote_key_prefx"),
        ({"lmcache.remote_url": "memcache://localhost:6379"}, {}, "remote_url"),
    ],
)
def test_bad_config_fails_with_the_key_named(extra, env, key):
    with pytest.raises(ConfigError) as e:
        load_config(extra, env=env)
    assert key in str(e.value)


def test_an_env_variable_that_is_not_a_key_is_not_read_and_a_near_miss_is_named(caplog):
    """LMCache reads only LMCACHE_<known key>; KVLens does the same, and names a likely typo."""
    import logging

    with caplog.at_level(logging.WARNING, logger="vllm.kvlens"):
        config = load_config({}, env={"LMCACHE_CHUNKSIZE": "512"})
    assert config.chunk_size == 256
    assert "LMCACHE_CHUNKSIZE" in caplog.text and "did you mean LMCACHE_CHUNK_SIZE" in caplog.text


def test_chunk_size_must_be_a_multiple_of_the_block_size():
    c = load_config({"lmcache.chunk_size": 192}, env={})
    with pytest.raises(ConfigError, match="chunk_size"):
        c.check_block_size(128)
    c.check_block_size(64)


def test_vllm_level_extra_keys_and_force_skip_env():
    c = load_config(
        {"discard_partial_chunks": True, "skip_last_n_tokens": 3}, env={"LMCACHE_FORCE_SKIP_SAVE": "1"}
    )
    assert c.discard_partial_chunks and c.skip_last_n_tokens == 3 and c.force_skip_save


def test_missing_yaml_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="LMCACHE_CONFIG_FILE"):
        load_config({}, env={"LMCACHE_CONFIG_FILE": str(tmp_path / "nope.yaml")})


def test_lmcache_features_kvlens_lacks_are_accepted_off_and_refused_on():
    load_config({"lmcache.enable_p2p": False}, env={})
    with pytest.raises(ConfigError, match="enable_p2p.*not supported by KVLens"):
        load_config({"lmcache.enable_p2p": True}, env={})
    assert load_config({"lmcache.enable_async_loading": True}, env={}).enable_async_loading


def test_layerwise_copies_are_on_by_default_and_can_be_turned_off():
    assert load_config({}, env={}).use_layerwise is True
    assert load_config({"lmcache.use_layerwise": False}, env={}).use_layerwise is False
    assert load_config({}, env={"LMCACHE_USE_LAYERWISE": "false"}).use_layerwise is False


def test_known_lmcache_keys_that_do_not_apply_are_a_warning_not_an_error(caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="vllm.kvlens"):
        config = load_config(
            {"lmcache.enable_p2p": False},
            env={"LMCACHE_USE_EXPERIMENTAL": "True", "LMCACHE_NUMA_MODE": "auto"},
        )
    assert config.chunk_size == 256
    assert "numa_mode" in caplog.text and "enable_p2p" in caplog.text


def test_an_unknown_key_is_still_an_error_naming_it():
    with pytest.raises(ConfigError, match="chunk_sise"):
        load_config({"lmcache.chunk_sise": 128}, env={})


def test_remote_url_password_comes_from_the_environment_and_is_never_printed():
    c = load_config(
        {"lmcache.remote_url": "redis://127.0.0.1:6379/2"}, env={"KVLENS_REDIS_PASSWORD": "s3cret"}
    )
    assert c.remote.password == "s3cret" and c.tier_names() == ("cpu", "remote")
    assert "s3cret" not in str(c.summary()) and "s3cret" not in repr(c.remote)
    with pytest.raises(ConfigError) as e:
        load_config({"lmcache.remote_url": "redis://:pw-in-url@h:99999"}, env={})
    assert "pw-in-url" not in str(e.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("lmcache.max_local_cpu_size", "1" * 400),  # parses as a float: infinity
        ("lmcache.max_local_cpu_size", "inf"),
        ("lmcache.extra_config.tier_timeout_s", "nan"),
    ],
)
def test_an_infinite_or_nan_number_is_a_config_error_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=key.split(".")[-1]):
        load_config({key: value}, env={})
