"""KVLens configuration: LMCache's names, sources and precedence, read once at start-up.

Precedence, lowest first: defaults < YAML file named by ``LMCACHE_CONFIG_FILE`` <
``LMCACHE_<KEY>`` environment variables < ``lmcache.<key>`` entries in vLLM's
``kv_connector_extra_config``. This module is the only code that reads any of them; the model
is in ``config_model.py``, what each LMCache key means in ``config_keys.py`` and the checks that
turn the sources into a model (or one error naming every problem) in ``config_rules.py``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import yaml

from .keys import FEATURES, UNUSED
from .model import GB, MB, ConfigError, ExtraConfig, KVLensConfig
from .rules import (
    ENV_PREFIX,
    EXTRA_PREFIX,
    FILE_ENV,
    FORCE_SKIP_ENV,
    Setting,
    build,
    near_env_key,
    parse_mapping_text,
    parse_scalar,
    reads_env_key,
)

__all__ = ["GB", "MB", "ConfigError", "ExtraConfig", "KVLensConfig", "load_config"]

# Every LMCache key KVLens accepts without using it, or refuses when it turns a feature on.
LMCACHE_KEYS_NOT_USED = frozenset(UNUSED) | frozenset(FEATURES)


def load_config(
    extra_config: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> KVLensConfig:
    """Build the config from YAML, environment and vLLM's extra config, in that precedence.

    Raises ConfigError naming every key that is unknown, refused or invalid, and where it
    came from; logs one warning listing the LMCache settings accepted and not used.
    """
    env = os.environ if env is None else env
    layers: list[list[Setting]] = []
    path = env.get(FILE_ENV)
    if path:
        source = f"{FILE_ENV} {path}"
        layers.append([Setting(str(k), v, source) for k, v in _from_yaml(path).items()])
    layers.append(_from_env(env))
    layers.append(_from_extra(extra_config or {}))
    return build(layers, env)


def _from_env(env: Mapping[str, str]) -> list[Setting]:
    """``LMCACHE_<KEY>`` for every key KVLens or LMCache knows. Other ``LMCACHE_*`` variables
    belong to other parts of LMCache (LMCACHE_LOG_LEVEL, LMCACHE_USAGE_TRACK_URL, ...) and are not
    read, as LMCache's config does not read them; one that resembles a key's variable is named
    in the start-up warning."""
    out: list[Setting] = []
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name == FILE_ENV:
            continue
        source = f"env {name}"
        if name == FORCE_SKIP_ENV:  # a process flag of LMCache's vLLM adapter, not a config key
            if raw.strip():
                skip = raw.strip().lower() not in ("0", "false", "no")
                out.append(Setting("force_skip_save", skip, source))
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if reads_env_key(key):
            value = parse_mapping_text(raw) if key == "extra_config" else parse_scalar(raw)
            out.append(Setting(key, value, source, raw=raw))
        elif (near := near_env_key(key)) is not None:
            out.append(Setting(key, None, source, hint=ENV_PREFIX + near.upper()))
    return out


def _from_yaml(path: str) -> dict[Any, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"{FILE_ENV}={path!r} cannot be read: {e}") from e
    except (yaml.YAMLError, ValueError, RecursionError) as e:  # as in parse_scalar
        raise ConfigError(f"{FILE_ENV}={path!r} is not valid YAML: {str(e)[:200]}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{FILE_ENV}={path!r} must hold a mapping of keys")
    return data


def _from_extra(extra: Mapping[Any, Any]) -> list[Setting]:
    out: list[Setting] = []
    for name, value in extra.items():
        source = f"kv_connector_extra_config {str(name)[:80]!r}"
        if isinstance(name, str) and name.startswith(EXTRA_PREFIX):
            out.append(Setting(name[len(EXTRA_PREFIX) :], value, source))
        else:  # vLLM-level: LMCache's adapter reads a few of these without the prefix
            out.append(Setting(str(name), value, source, vllm_level=True))
    return out
