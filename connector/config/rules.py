"""From LMCache-style settings to a KVLensConfig, or one error naming every problem.

The rule: a key KVLens reads is validated; an LMCache key or ``extra_config`` entry KVLens has no
use for is accepted and listed in one warning; a setting that turns on an LMCache feature KVLens
does not have stops start-up with "not supported by KVLens", naming the setting, where it came
from and what to use instead; a key neither knows is an unknown key, with the nearest known
name suggested. Every message is KVLens's own sentence (the validator's are translated), and
none shows a password.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import SecretStr, ValidationError

from ..tiers.remote_url import parse_remote_url, with_credentials, with_database
from .blend import BLEND_KEYS, length_problems
from .disk_space import disk_budget_warning
from .keys import (
    ALIASES,
    EXTRA_FEATURES,
    FEATURES,
    FIELD_ALIASES,
    REMOTE_BACKENDS,
    UNUSED,
    Feature,
    canonical,
    extra_lmcache_knows,
    lmcache_knows,
    nearest,
)
from .model import ConfigError, ExtraConfig, KVLensConfig
from .pd import PD_KEYS, exposure_problems, tls_problems, with_deployment_key
from .pd import read as read_pd
from .sentences import describe, short

logger = logging.getLogger("vllm.kvlens")

ENV_PREFIX = "LMCACHE_"
EXTRA_PREFIX = "lmcache."
FILE_ENV = "LMCACHE_CONFIG_FILE"
FORCE_SKIP_ENV = "LMCACHE_FORCE_SKIP_SAVE"
VLLM_LEVEL_KEYS = ("discard_partial_chunks", "skip_last_n_tokens")
# vLLM-level keys LMCache's adapter reads that KVLens has no use for.
LMCACHE_VLLM_LEVEL = ("lmcache_rpc_port",)

FIELDS = frozenset(KVLensConfig.model_fields) - {"extra_config"}
EXTRA_FIELDS = frozenset(ExtraConfig.model_fields)
BOOL_FIELDS = frozenset(n for n, f in KVLensConfig.model_fields.items() if f.annotation in (bool, "bool"))
KNOWN = sorted(
    FIELDS | set(UNUSED) | set(FEATURES) | set(ALIASES) | set(FIELD_ALIASES) | PD_KEYS | {"extra_config"}
)
# Said once at start-up when an LMCache blending configuration sets use_layerwise.
LAYERWISE_NOTE = (
    "KVLens needs no layerwise mode for blending (LMCache's blending requires use_layerwise: true); "
    "use_layerwise only decides whether KVLens copies KV a layer at a time beside the forward pass"
)


@dataclass(frozen=True, slots=True)
class Setting:
    key: str
    value: Any
    source: str  # where it came from, as error messages name it
    raw: str | None = None  # the environment's text (LMCache reads booleans from the text)
    vllm_level: bool = False  # a kv_connector_extra_config key without the lmcache. prefix
    hint: str | None = None  # an LMCACHE_* variable that is not a key: the key's variable it resembles


# LMCache process switches read only from the environment (LMCACHE_USE_EXPERIMENTAL): not keys
# there, so not read; in a file they are keys of its early versions (one warning).
ENV_PROCESS_FLAGS = frozenset({"use_experimental"})


def reads_env_key(key: str) -> bool:
    """Whether ``LMCACHE_<KEY>`` is read: only for keys KVLens or LMCache knows, as LMCache does."""
    if key.startswith("ec_") or key in ENV_PROCESS_FLAGS:  # not configuration keys there
        return False
    return (
        key == "extra_config"
        or key.startswith("extra_config.")
        or key in FIELDS
        or lmcache_knows(key)
        or canonical(key) in PD_KEYS
    )


def near_env_key(key: str) -> str | None:
    """The key whose variable ``LMCACHE_<KEY>`` resembles; LMCache's own LMCACHE_EC_* overrides
    (the encoder cache's copy of the config) are not typos."""
    if key.startswith("ec_") or key in ENV_PROCESS_FLAGS:
        return None
    return nearest(key, KNOWN, cutoff=0.85)


def parse_scalar(raw: str) -> Any:
    """Text as JSON/YAML data ("256", "null", "{...}"); text YAML cannot read stays text.

    ValueError is an integer past Python's int-to-str digit limit, RecursionError deep nesting.
    """
    try:
        return yaml.safe_load(raw)
    except (yaml.YAMLError, ValueError, RecursionError):
        return raw


def parse_mapping_text(text: str) -> Any:
    """An extra_config given as text: JSON, else YAML (``{'use_odirect': True}`` as LMCache's
    docs write it is YAML, not JSON)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return parse_scalar(text)


class _Verdict:
    """What the checks found: values to validate, settings accepted unused, problems."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.sources: dict[str, str] = {}
        self.extra: dict[str, Any] = {}
        self.extra_sources: dict[str, str] = {}
        self.unused: list[str] = []
        self.refused: list[str] = []
        self.unknown: list[str] = []
        self.invalid: list[str] = []
        self.has_remote = False  # remote_url is set (remote_serde matters only then)
        self.pd: dict[str, tuple[Any, str, str]] = {}  # PD keys: (value, source, key as written)

    def refuse(self, label: str, source: str, feature: Feature, verb: str = "turns on") -> None:
        self.refused.append(
            f"{label} (from {source}) {verb} {feature.name}, which is not supported by KVLens; "
            f"instead: {feature.instead}"
        )

    def problems(self) -> list[str]:
        return self.refused + self.unknown + self.invalid


def build(layers: list[list[Setting]], env: Mapping[str, str]) -> KVLensConfig:
    """Merge the layers (later wins, ``extra_config`` entry by entry), check, validate."""
    v = _Verdict()
    top: dict[str, Setting] = {}
    for layer in layers:
        for s in layer:
            _place(s, top, v)
    v.has_remote = "remote_url" in top and bool(top["remote_url"].value)
    for key, s in top.items():
        _check_top(key, s, v)
    if "use_layerwise" in top and any(key in top for key in BLEND_KEYS):
        logger.info("%s", LAYERWISE_NOTE)
    for key in list(v.extra):
        _check_extra(key, v)
    pd = read_pd(v.pd)
    v.refused += pd.refused
    v.invalid += pd.invalid
    v.unused += pd.unused
    config = None
    try:
        context = {"pd": pd.config.enabled}  # a PD engine may keep no tier of its own
        config = KVLensConfig.model_validate({**v.values, "extra_config": v.extra}, context=context)
    except ValidationError as e:
        # Without a refused or unknown key the whole may be fine ("no storage tier" while the
        # refused remote_url is the tier): say only what is wrong with the values themselves.
        v.invalid += describe(e, v.sources, v.extra_sources, whole=not (v.refused or v.unknown))
    if config is not None:
        lengths = (config.blend_check_layers, config.blend_recompute_ratios, config.blend_thresholds)
        v.invalid += length_problems(*lengths, v.sources)
    if config is not None and (v.refused or v.unknown):
        config = None
    if config is not None:
        config = _with_remote(config, v, env)
    if config is not None:
        config._store_auth_key = _store_auth_key(config, v, env)
    pd_config = with_deployment_key(pd.config, config.store_auth_key if config is not None else None)
    v.invalid += exposure_problems(pd_config) + tls_problems(pd_config)
    if v.problems():
        raise ConfigError("KVLens cannot start with this configuration: " + "; ".join(v.problems()))
    assert config is not None
    config._unused = tuple(v.unused)
    config._pd = pd_config
    if pd_config.enabled and pd_config.auth_key is None and pd_config.allow_unauthenticated:
        logger.warning(
            "KVLens PD without a key (pd_allow_unauthenticated: true): anyone who reaches the PD ports "
            "can hand this decoder KV, and a prefiller sends to receivers that prove nothing"
        )
    if v.unused:
        logger.warning("KVLens accepts and does not use these LMCache settings: %s", "; ".join(v.unused))
    if (said := disk_budget_warning(config, v.sources.get("max_local_disk_size", "default"))) is not None:
        logger.warning("%s", said)
    return config


def _place(s: Setting, top: dict[str, Setting], v: _Verdict) -> None:
    if s.hint is not None:
        v.unused.append(f"{s.source} (not a configuration key, so not read; did you mean {s.hint}?)")
        return
    if s.vllm_level:
        if s.key in VLLM_LEVEL_KEYS:
            top[s.key] = s
        elif s.key in LMCACHE_VLLM_LEVEL:
            v.unused.append(f"{s.key} (from {s.source})")
        else:
            v.unused.append(f"{s.key[:80]} (from {s.source}; KVLens reads lmcache.<key> entries)")
        return
    key = s.key.strip().lower()
    if key == "extra_config":
        value = parse_mapping_text(s.value) if isinstance(s.value, str) else s.value
        if not isinstance(value, dict):
            v.invalid.append(f"extra_config (from {s.source}) must be a mapping of keys, not {short(value)}")
            return
        for sub, item in value.items():
            v.extra[str(sub)] = item
            v.extra_sources[str(sub)] = s.source
    elif key.startswith("extra_config."):
        sub = s.key.strip()[len("extra_config.") :]
        v.extra[sub] = s.value
        v.extra_sources[sub] = s.source
    elif key in FIELD_ALIASES:
        _place_alias(key, s, top, v)
    else:
        if key in FIELD_ALIASES.values() and key in top and top[key].source.startswith(s.source + ", as "):
            v.invalid.append(_both_names(key, s.source))
        top[key] = s


def _place_alias(alias: str, s: Setting, top: dict[str, Setting], v: _Verdict) -> None:
    """An older LMCache name sets its key, at the precedence of where it is written."""
    name = FIELD_ALIASES[alias]
    if name in top and top[name].source == s.source:
        v.invalid.append(_both_names(name, s.source))
    top[name] = Setting(name, s.value, f"{s.source}, as {alias}", raw=s.raw)


def _both_names(name: str, source: str) -> str:
    old = next(alias for alias, key in FIELD_ALIASES.items() if key == name)
    return f"{name} and its older name {old} are both set (in {source}); set {name} only"


def _check_top(key: str, s: Setting, v: _Verdict) -> None:
    name = canonical(key)
    if name in PD_KEYS:
        v.pd[name] = (_lmcache_text(s), s.source, key)
        return
    if name.startswith("ec_") and (lmcache_knows(name[3:]) or name[3:] in FIELDS):
        v.unused.append(
            f"{key} (from {s.source}; LMCache's override for its encoder cache, which KVLens has not)"
        )
        return
    if key in FIELDS:
        value = _field_value(key, s, v)
        if value is not _REFUSED:
            v.values[key] = value
            v.sources[key] = s.source
    elif name in FEATURES:
        feature = FEATURES[name]
        value = _lmcache_text(s)
        on = _is_on(feature, value)
        if on is None:
            v.invalid.append(f"{key} (from {s.source}) must be true or false, not {short(value)}")
        elif on:
            v.refuse(f"{key} = {short(value)}", s.source, feature)
        else:
            v.unused.append(f"{key} (from {s.source})")
    elif name in UNUSED:
        hint = UNUSED[name]
        v.unused.append(f"{key} (from {s.source}" + (f"; {hint})" if hint else ")"))
    else:
        near = nearest(key, KNOWN)
        v.unknown.append(
            f"unknown key {key[:80]!r} (from {s.source}): neither KVLens nor LMCache has it"
            + (f"; did you mean {near!r}?" if near else "")
        )


_REFUSED = object()


def _field_value(key: str, s: Setting, v: _Verdict) -> Any:
    """The value to validate, read as LMCache reads it; _REFUSED when it turns on what KVLens lacks."""
    value = s.value
    if key in BOOL_FIELDS:
        return _lmcache_bool_field(key, s, v)
    if key == "remote_serde" and isinstance(value, str):
        text = value.strip().lower()
        if text == "naive":
            return "naive"
        if not v.has_remote:  # LMCache serializes only for a remote backend: no effect either
            v.unused.append(f"remote_serde = {short(value)} (from {s.source}; no remote_url)")
            return "naive"
        what = "CacheGen compression of remote KV" if text == "cachegen" else f"the {short(value)} serializer"
        v.refuse(
            f"remote_serde = {short(value)}",
            s.source,
            Feature(what, "remote_serde: naive (or null): KVLens stores KV as it is", bool),
        )
        return _REFUSED
    if key == "cache_policy" and isinstance(value, str) and value.strip().upper() == "COST_AWARE":
        v.refuse(
            "cache_policy = 'COST_AWARE'",
            s.source,
            Feature("LMCache's cost-aware eviction", "cache_policy: LRU, LFU, FIFO or MRU", bool),
        )
        return _REFUSED
    if key == "remote_url" and isinstance(value, str) and "://" in value:
        scheme = value.split("://", 1)[0].strip().lower()
        if scheme in REMOTE_BACKENDS:
            instead = (
                "a Redis-protocol store (redis://, rediss://, unix://, valkey://, redis-cluster:// or "
                "redis-sentinel://)"
            )
            if scheme == "fs":
                instead = "local_disk: <path> (KVLens's disk tier is shared by engines on one filesystem)"
            feature = Feature(REMOTE_BACKENDS[scheme], instead, bool)
            v.refuse(f"remote_url {scheme}://...", s.source, feature, verb="points at")
            return _REFUSED
    return value


def _lmcache_bool_field(key: str, s: Setting, v: _Verdict) -> Any:
    """LMCache's reading: only true and 1 (any case) are true; other text is false, and said so."""
    value = _lmcache_text(s)
    if isinstance(value, bool) or value is None or not isinstance(value, str | int | float):
        return value
    try:
        text = str(value).strip().lower()
    except ValueError:  # an integer past the int-to-str digit limit
        return value
    if text not in ("true", "1", "false", "0"):
        v.unused.append(f"{key} = {short(value)} (from {s.source}) read as false: only true and 1 are true")
    return text in ("true", "1")


def _lmcache_text(s: Setting) -> Any:
    """An environment value as LMCache reads it: the text, without one pair of enclosing quotes
    (its ``_parse_quoted_string``); other sources' values as they are."""
    if s.raw is None:
        return s.value
    text = s.raw.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _is_on(feature: Feature, value: Any) -> bool | None:
    try:
        return bool(feature.on(value))
    except (ValueError, TypeError, RecursionError):
        return None


def _check_extra(key: str, v: _Verdict) -> None:
    source = v.extra_sources[key]
    if key in EXTRA_FIELDS:
        return
    value = v.extra.pop(key)
    feature = EXTRA_FEATURES.get(key)
    if feature is not None:
        on = _is_on(feature, value)
        if on:
            v.refuse(f"extra_config.{key} = {short(value)}", source, feature)
            return
    if not extra_lmcache_knows(key):
        near = nearest(key, EXTRA_FIELDS, cutoff=0.8)
        if near is not None:
            v.unknown.append(
                f"unknown key 'extra_config.{key[:80]}' (from {source}): not an entry KVLens reads; "
                f"did you mean 'extra_config.{near}'?"
            )
            return
    v.unused.append(f"extra_config.{key[:80]} (from {source})")


def _with_remote(config: KVLensConfig, v: _Verdict, env: Mapping[str, str]) -> KVLensConfig | None:
    """Parse remote_url with extra_config's Valkey / RESP settings; the URL's timeout becomes
    remote_timeout_s."""
    extra = config.extra_config
    valkey_keys = [k for k in _VALKEY_KEYS if k in v.extra]
    resp_keys = [k for k in ("username", "password") if k in v.extra]
    if not config.remote_url:
        for k in valkey_keys + resp_keys:
            v.unused.append(f"extra_config.{k} (from {v.extra_sources[k]}; no remote_url)")
        return config
    scheme = config.remote_url.split("://", 1)[0].strip().lower()
    valkey = scheme.startswith("valkey")
    try:
        cluster = valkey and extra.valkey_mode == "cluster"
        url = parse_remote_url(config.remote_url, environ=env, cluster=cluster)
        if valkey:
            url = with_credentials(url, extra.valkey_username, _secret(extra.valkey_password))
            if extra.valkey_database is not None:
                url = with_database(url, extra.valkey_database)
        elif scheme == "resp":
            url = with_credentials(url, extra.username, _secret(extra.password))
    except ValueError as e:
        v.invalid.append(f"remote_url (from {v.sources.get('remote_url', 'config')}): {e}")
        return None
    ignored = valkey_keys if not valkey else []
    ignored += resp_keys if scheme != "resp" else []
    v.unused += [f"extra_config.{k} (from {v.extra_sources[k]}; remote_url is {scheme}://)" for k in ignored]
    v.unused += [
        f"remote_url option {name} (KVLens does not retry a failed call: it counts it and skips "
        "the tier until a probe succeeds)"
        for name in url.ignored_options
    ]
    if url.timeout_s is not None:
        if "remote_timeout_s" in v.extra and extra.remote_timeout_s != url.timeout_s:
            v.invalid.append(
                "remote_url's socket timeout and extra_config.remote_timeout_s "
                f"(from {v.extra_sources['remote_timeout_s']}) disagree; set one of them"
            )
            return None
        config = config.model_copy(
            update={"extra_config": extra.model_copy(update={"remote_timeout_s": url.timeout_s})}
        )
    config._remote = url
    return config


STORE_AUTH_KEY_ENV = "KVLENS_STORE_AUTH_KEY"


def _store_auth_key(config: KVLensConfig, v: _Verdict, env: Mapping[str, str]) -> bytes | None:
    """The shared stores' key: extra_config's, its file's (one trailing newline dropped) or
    the environment's."""
    extra = config.extra_config
    if extra.store_auth_key is not None:
        return extra.store_auth_key.get_secret_value().encode()
    if extra.store_auth_key_file is not None:
        try:
            with open(extra.store_auth_key_file, "rb") as f:
                secret = f.read().removesuffix(b"\n").removesuffix(b"\r")
        except OSError as e:
            v.invalid.append(f"extra_config.store_auth_key_file cannot be read: {e.strerror or e}")
            return None
        where = "extra_config.store_auth_key_file"
    elif env.get(STORE_AUTH_KEY_ENV):
        secret, where = env[STORE_AUTH_KEY_ENV].encode(), STORE_AUTH_KEY_ENV
    else:
        return None
    if len(secret) < 16:
        v.invalid.append(f"{where}: the store key must be at least 16 characters")
        return None
    return secret


_VALKEY_KEYS = ("valkey_username", "valkey_password", "valkey_database", "valkey_mode")


def _secret(value: SecretStr | None) -> str | None:
    return value.get_secret_value() if value is not None else None
