"""LMCache's blend settings are read from every source, checked naming the key, and blending itself
is refused until the blender exists."""

from __future__ import annotations

import logging

import pytest

from connector.config.blend import BlendSettings
from connector.config.loading import ConfigError, load_config
from connector.config.rules import LAYERWISE_NOTE


def _nested(depth: int) -> object:
    value: object = "x"
    for _ in range(depth):
        value = {"k": [value]}
    return value


def error(extra=None, env=None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(extra or {}, env=env or {})
    return str(e.value)


def test_defaults_are_lmcaches():
    config = load_config({}, env={})
    assert not config.enable_blending
    assert (config.blend_special_str, config.blend_min_tokens) == (" # # ", 256)
    assert config.blend_recompute_ratios is None and config.blend_check_layers is None
    assert config.blend_thresholds is None
    assert config.blend == BlendSettings(" # # ", (1,), (0.15,), None, 256)


def test_the_same_settings_from_yaml_env_and_extra_config(tmp_path):
    path = tmp_path / "blend.yaml"
    path.write_text(
        'blend_special_str: " ## "\nblend_recompute_ratios: [0.1, 0.2]\nblend_check_layers: [1, 4]\n'
        "blend_thresholds: 0.5\nblend_min_tokens: 64\n"
    )
    from_yaml = load_config({}, env={"LMCACHE_CONFIG_FILE": str(path)})
    from_env = load_config(
        {},
        env={
            "LMCACHE_BLEND_SPECIAL_STR": '" ## "',
            "LMCACHE_BLEND_RECOMPUTE_RATIOS": "0.1,0.2",
            "LMCACHE_BLEND_CHECK_LAYERS": "1, 4",
            "LMCACHE_BLEND_THRESHOLDS": "0.5",
            "LMCACHE_BLEND_MIN_TOKENS": "64",
        },
    )
    from_extra = load_config(
        {
            "lmcache.blend_special_str": " ## ",
            "lmcache.blend_recompute_ratios": [0.1, 0.2],
            "lmcache.blend_check_layers": "[1, 4]",
            "lmcache.blend_thresholds": [0.5],
            "lmcache.blend_min_tokens": 64,
        },
        env={},
    )
    for config in (from_yaml, from_env, from_extra):
        assert config.blend == BlendSettings(" ## ", (1, 4), (0.1, 0.2), (0.5, 0.5), 64)


def test_lmcaches_example_environment_reads_as_one_check_layer_and_one_ratio():
    env = {"LMCACHE_BLEND_CHECK_LAYERS": "1", "LMCACHE_BLEND_RECOMPUTE_RATIOS": "0.15"}
    config = load_config({}, env=env)
    assert (config.blend_check_layers, config.blend_recompute_ratios) == ((1,), (0.15,))


def test_extra_config_wins_over_env_as_for_every_key():
    config = load_config({"lmcache.blend_check_layers": 3}, env={"LMCACHE_BLEND_CHECK_LAYERS": "1"})
    assert config.blend_check_layers == (3,)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"lmcache.blend_recompute_ratios": 1.5}, "blend_recompute_ratios (from kv_connector_extra_config"),
        ({"lmcache.blend_recompute_ratios": [0.1, -0.1]}, "between 0 and 1"),
        ({"lmcache.blend_recompute_ratios": []}, "at least one ratio"),
        ({"lmcache.blend_recompute_ratios": "x"}, "must be numbers ('x' is not one)"),
        ({"lmcache.blend_recompute_ratios": True}, "(true or false is not one)"),
        ({"lmcache.blend_recompute_ratios": float("nan")}, "finite"),
        ({"lmcache.blend_check_layers": -1}, "blend_check_layers (from kv_connector_extra_config"),
        ({"lmcache.blend_check_layers": [1.5]}, "whole numbers"),
        ({"lmcache.blend_check_layers": [2, 2]}, "must not name a layer twice"),
        ({"lmcache.blend_thresholds": [-0.5]}, "blend_thresholds (from kv_connector_extra_config"),
        ({"lmcache.blend_min_tokens": -1}, "blend_min_tokens (from kv_connector_extra_config"),
        ({"lmcache.blend_min_tokens": "many"}, "blend_min_tokens (from kv_connector_extra_config"),
        ({"lmcache.blend_special_str": ""}, "blend_special_str (from kv_connector_extra_config"),
        ({"lmcache.blend_special_str": 5}, "blend_special_str (from kv_connector_extra_config"),
    ],
)
def test_a_wrong_value_stops_start_up_naming_the_key_and_source(extra, says):
    message = error(extra)
    assert says in message and "pydantic" not in message and "Input should" not in message


def test_an_environment_value_is_named_with_its_variable():
    message = error(env={"LMCACHE_BLEND_CHECK_LAYERS": "1,x"})
    assert (
        "blend_check_layers (from env LMCACHE_BLEND_CHECK_LAYERS) must be numbers ('x' is not one)" in message
    )


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (
            {"lmcache.blend_check_layers": [1, 2, 3], "lmcache.blend_recompute_ratios": [0.1, 0.2]},
            "blend_recompute_ratios (from kv_connector_extra_config 'lmcache.blend_recompute_ratios') has "
            "2 values for 3 check layers (blend_check_layers, from kv_connector_extra_config",
        ),
        (
            {"lmcache.blend_thresholds": [0.1, 0.2]},
            "blend_thresholds (from kv_connector_extra_config 'lmcache.blend_thresholds') has 2 values "
            "for 1 check layer (blend_check_layers, from default)",
        ),
    ],
)
def test_ratios_and_thresholds_give_one_value_or_one_per_check_layer(extra, says):
    assert says in error(extra)


def test_one_value_or_one_per_layer_is_accepted_and_paired_in_order():
    config = load_config(
        {"lmcache.blend_check_layers": [5, 1], "lmcache.blend_recompute_ratios": [0.3, 0.1]}, env={}
    )
    assert list(zip(config.blend.check_layers, config.blend.recompute_ratios, strict=True)) == [
        (5, 0.3),
        (1, 0.1),
    ]
    one = load_config({"lmcache.blend_check_layers": [1, 2, 3], "lmcache.blend_thresholds": 2}, env={})
    assert one.blend.thresholds == (2.0, 2.0, 2.0) and one.blend.recompute_ratios == (0.15, 0.15, 0.15)


def test_the_older_singular_ratio_is_read_as_one_ratio_from_every_source(tmp_path):
    assert load_config({"lmcache.blend_recompute_ratio": 0.2}, env={}).blend_recompute_ratios == (0.2,)
    env = {"LMCACHE_BLEND_RECOMPUTE_RATIO": "0.25"}
    assert load_config({}, env=env).blend_recompute_ratios == (0.25,)
    path = tmp_path / "old.yaml"
    path.write_text("blend_recompute_ratio: 0.3\n")
    config = load_config({}, env={"LMCACHE_CONFIG_FILE": str(path)})
    assert config.blend_recompute_ratios == (0.3,) and not config.unused_settings


def test_the_older_name_keeps_its_sources_precedence():
    config = load_config(
        {"lmcache.blend_recompute_ratio": 0.2}, env={"LMCACHE_BLEND_RECOMPUTE_RATIOS": "0.5"}
    )
    assert config.blend_recompute_ratios == (0.2,)
    config = load_config(
        {"lmcache.blend_recompute_ratios": 0.4}, env={"LMCACHE_BLEND_RECOMPUTE_RATIO": "0.5"}
    )
    assert config.blend_recompute_ratios == (0.4,)


def test_a_wrong_older_name_is_named_as_written():
    message = error({"lmcache.blend_recompute_ratio": 2})
    assert "as blend_recompute_ratio) must be shares between 0 and 1" in message


def test_both_names_in_one_source_are_refused(tmp_path):
    path = tmp_path / "both.yaml"
    path.write_text("blend_recompute_ratios: [0.1]\nblend_recompute_ratio: 0.2\n")
    message = error(env={"LMCACHE_CONFIG_FILE": str(path)})
    assert "blend_recompute_ratios and its older name blend_recompute_ratio are both set" in message
    path.write_text("blend_recompute_ratio: 0.2\nblend_recompute_ratios: [0.1]\n")
    assert "are both set" in error(env={"LMCACHE_CONFIG_FILE": str(path)})


@pytest.mark.parametrize(
    ("extra", "env"),
    [
        ({"lmcache.enable_blending": True}, {}),
        ({}, {"LMCACHE_ENABLE_BLENDING": "True"}),
        ({"lmcache.enable_blending": "1"}, {}),
    ],
)
def test_blending_turns_on_from_each_of_lmcaches_sources(extra, env):
    assert load_config(extra, env=env).enable_blending is True


def test_blending_on_with_a_wrong_blend_value_names_the_value():
    message = error({"lmcache.enable_blending": True, "lmcache.blend_check_layers": -2})
    assert "blend_check_layers (from" in message and "enable_blending" not in message


@pytest.mark.parametrize("value", [False, "False", "0", "no"])
def test_blending_off_starts(value):
    assert load_config({"lmcache.enable_blending": value}, env={}).enable_blending is False


def test_lmcaches_blend_settings_are_not_listed_as_unused():
    config = load_config(
        {"lmcache.blend_special_str": " # # ", "lmcache.blend_min_tokens": 128, "lmcache.enable_blending": 0},
        env={},
    )
    assert not config.unused_settings


def test_the_older_separator_key_is_accepted_unused_pointing_at_the_current_one():
    config = load_config({"lmcache.blend_separator": "[SEP]"}, env={})
    assert any("blend_separator" in s and "blend_special_str" in s for s in config.unused_settings)


def test_use_layerwise_beside_blend_settings_is_noted_once_and_keeps_its_meaning(caplog):
    extra = {"lmcache.use_layerwise": True, "lmcache.blend_check_layers": 1, "lmcache.blend_min_tokens": 8}
    with caplog.at_level(logging.INFO, logger="vllm.kvlens"):
        config = load_config(extra, env={})
    assert [r.getMessage() for r in caplog.records].count(LAYERWISE_NOTE) == 1
    assert config.use_layerwise is True


def test_use_layerwise_is_noted_once_when_blending_is_on(caplog):
    with caplog.at_level(logging.INFO, logger="vllm.kvlens"):
        load_config({}, env={"LMCACHE_ENABLE_BLENDING": "True", "LMCACHE_USE_LAYERWISE": "True"})
    assert [r.getMessage() for r in caplog.records].count(LAYERWISE_NOTE) == 1


def test_use_layerwise_alone_says_nothing_about_blending(caplog):
    with caplog.at_level(logging.INFO, logger="vllm.kvlens"):
        load_config({"lmcache.use_layerwise": False}, env={})
    assert LAYERWISE_NOTE not in [r.getMessage() for r in caplog.records]


def test_check_layers_beyond_the_model_are_named_once_the_model_is_known():
    settings = BlendSettings.of(" # # ", (1, 30, 40), None, None, 256)
    said = "blend_check_layers names layer 40, but the model has 32 layers (0 to 31)"
    assert settings.layers_problem(32) == said
    assert settings.layers_problem(41) is None


@pytest.mark.parametrize(
    "value",
    [[_nested(3000)], {"a": 1}, 10**5000, "1" * 5000, [10**400]],
    ids=["deeply nested", "mapping", "huge int", "huge text", "huge int in a list"],
)
def test_hostile_list_values_are_named_errors(value):
    assert "blend_recompute_ratios (from" in error({"lmcache.blend_recompute_ratios": value})
