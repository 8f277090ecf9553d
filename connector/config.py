"""KVLens configuration: one validated model, LMCache-compatible names and precedence.

Precedence, lowest first: defaults < YAML file named by ``LMCACHE_CONFIG_FILE`` <
``LMCACHE_<KEY>`` environment variables < ``lmcache.<key>`` entries in vLLM's
``kv_connector_extra_config``. This module is the only code that reads any of them.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from .tiers.remote_url import RemoteURL, parse_remote_url

logger = logging.getLogger("vllm.kvlens")

GB = 1024**3
MB = 1024**2

ENV_PREFIX = "LMCACHE_"
EXTRA_PREFIX = "lmcache."
# Process-level LMCache variables that are not config keys; accepted and not treated as keys.
_ENV_NOT_KEYS = frozenset(
    {"CONFIG_FILE", "FORCE_SKIP_SAVE", "LOG_LEVEL", "LOGLEVEL", "TRACK_USAGE", "USE_EXPERIMENTAL"}
)

# LMCache configuration keys that have no meaning in KVLens (P2P, PD, controller, GDS, blending
# tuning, ...). A migrating user's config may carry them: they are ignored with one warning.
# Any other key KVLens does not know is a typo and a start-up error.
LMCACHE_KEYS_NOT_USED = frozenset(
    """local_cpu_use_hugepages reserve_local_cpu_size local_disk_path_sharding pre_caching_hash_algorithm
    blend_recompute_ratios blend_thresholds blend_check_layers blend_min_tokens blend_special_str
    blend_recompute_ratio retrieve_locations store_location enable_p2p p2p_host p2p_init_ports
    p2p_lookup_ports mp_host mp_port enable_controller lmcache_instance_id controller_pull_url
    controller_reply_url controller_url lmcache_worker_ports lmcache_worker_port lmcache_worker_ids
    lmcache_worker_heartbeat_delay_time lmcache_worker_heartbeat_time enable_pd enable_xpyd pd_role
    pd_buffer_size pd_buffer_device pd_peer_host pd_peer_init_port pd_peer_alloc_port pd_peer_query_port
    pd_proxy_host pd_proxy_port pd_allocation_timeout_sec pd_shutdown_timeout_sec
    pd_condition_poll_interval_sec pd_max_prefill_len pd_backend_mode pd_skip_proxy_notification
    pd_bidirectional transfer_channel nixl_backends nixl_buffer_size nixl_buffer_device nixl_role
    nixl_peer_host nixl_peer_init_port nixl_peer_alloc_port nixl_peer_port nixl_proxy_host nixl_proxy_port
    nixl_receiver_host nixl_receiver_port nixl_enable_gc enable_nixl gds_path gds_path_sharding
    gds_buffer_size maru_path maru_pool_size use_gds gds_backend audit_actual_remote_url
    internal_api_server_host internal_api_server_enabled internal_api_server_port_start
    internal_api_server_include_index_list internal_api_server_socket_path_prefix blocking_timeout_secs
    external_lookup_client py_enable_gc cost_aware_half_life_seconds cost_aware_ewma_alpha numa_mode
    runtime_plugin_locations plugin_locations storage_plugins external_backends remote_storage_plugins
    lookup_timeout_ms lookup_backoff_time hit_miss_ratio lookup_server_worker_ids
    enable_scheduler_bypass_lookup script_allowed_imports enable_lazy_memory_allocator
    lazy_memory_initial_ratio lazy_memory_expand_trigger_ratio lazy_memory_step_ratio lazy_memory_safe_size
    enable_chunk_statistics chunk_statistics_auto_start_statistics chunk_statistics_auto_exit_timeout_hours
    chunk_statistics_auto_exit_target_unique_chunks chunk_statistics_strategy enable_kv_events
    use_gpu_connector_v3 pin_timeout_sec pin_check_interval_sec remote_config_url app_id
    enable_hidden_state_cache max_hidden_state_cpu_size hidden_state_layers hidden_states_retrieve_mode
    save_only_first_rank weka_path cufile_buffer_size local_device max_local_cache_size
    use_experimental""".split()
)


class ConfigError(ValueError):
    """A configuration problem, raised once at start-up with the offending key named."""


class ExtraConfig(BaseModel):
    """The ``extra_config`` dict: LMCache's open-ended knobs plus KVLens's own."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    # Report {"num_lmcache_cached_tokens": N} in each response's kv_transfer_params.
    enable_cache_usage_details_in_response: bool = True
    # Also store a prompt's unfull last chunk cut to whole vLLM blocks, and let lookups take
    # the longest stored whole-block prefix of a chunk: hits at block, not chunk, granularity.
    block_granular_tails: bool = True
    # How often the scheduler rescans the disk tier for chunks written by other engines.
    disk_scan_interval_s: float = Field(1.0, gt=0)
    # A chunk file another engine used for a load within this many seconds is not deleted.
    disk_shared_grace_s: float = Field(30.0, ge=0)
    # Longest wait on a slow tier (a disk or remote read, a queued write) before it counts as
    # failed and the tier is skipped until a probe succeeds.
    tier_timeout_s: float = Field(5.0, gt=0)
    # Bytes of chunk writes a background tier may hold queued; beyond, stores are dropped.
    max_pending_write_bytes: int = Field(512 * MB, gt=0)
    # Remote tier (remote_url): key prefix (namespace in a shared Redis), TTL of stored chunks
    # (null: none; let Redis evict with maxmemory-policy), per-operation timeout of data calls,
    # and the timeout of a lookup's one existence round trip, after which the remote is a miss.
    remote_key_prefix: str = Field("kvlens", pattern=r"^[A-Za-z0-9_.-]+$")
    remote_ttl_s: int | None = Field(None, gt=0)
    remote_timeout_s: float = Field(2.0, gt=0)
    remote_lookup_timeout_ms: float = Field(50.0, gt=0)
    # The operator's name for the model's weights (e.g. "llama-3.1-8b-instruct@0e9e39f"), used in
    # keys instead of a fingerprint of the checkpoint's content: instances that set the same
    # name share KV, whatever their files. Quantization and dtypes still count.
    model_identity: str | None = Field(None, min_length=1, max_length=256)
    # --- kvlens-cli (issue 20): the admin endpoint of connector/admin.py -----------------------
    # Port of a small HTTP endpoint the scheduler process serves for `kvlens clear` (namespace-
    # scoped clears applied between steps); null: none. Data-parallel engine i listens on port + i.
    admin_port: int | None = Field(None, ge=1, le=65535)
    admin_host: str = "127.0.0.1"  # no authentication: keep it on loopback unless fenced off


class KVLensConfig(BaseModel):
    """Every setting KVLens honours. Unknown keys and wrong types are start-up errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    chunk_size: int = Field(256, gt=0)
    local_cpu: bool = True
    max_local_cpu_size: float = Field(5.0, ge=0)  # GB
    local_disk: str | None = None
    max_local_disk_size: float = Field(0.0, ge=0)  # GB
    remote_url: str | None = None
    remote_serde: Literal["naive"] = "naive"
    cache_policy: Literal["LRU"] = "LRU"
    save_unfull_chunk: bool = False
    save_decode_cache: bool = False
    min_retrieve_tokens: int = Field(0, ge=0)
    priority_limit: int | None = None
    skip_last_n_tokens: int = Field(0, ge=0)
    discard_partial_chunks: bool = False
    force_skip_save: bool = False
    # Copy a step's loads and stores one layer at a time on a copy thread, beside the forward
    # pass (a layer's attention waits only for its own layer's loads). On by default, unlike
    # LMCache: it changes when copies run, never what is stored. CPU KV only (elsewhere the
    # copies run in the step, as with false).
    use_layerwise: bool = True
    # LMCache features KVLens does not have: accepted when off, a start-up error when on.
    enable_async_loading: Literal[False] = False
    enable_blending: Literal[False] = False
    extra_config: ExtraConfig = ExtraConfig()
    _remote: RemoteURL | None = PrivateAttr(None)

    @field_validator("local_disk")
    @classmethod
    def _strip_file_scheme(cls, value: str | None) -> str | None:
        if value and value.startswith("file://"):
            value = value[len("file://") :]
        return value or None

    @field_validator("remote_url")
    @classmethod
    def _remote_url_parses(cls, value: str | None) -> str | None:
        if value:
            parse_remote_url(value, environ={})  # the password may come from the environment later
        return value or None

    @property
    def remote(self) -> RemoteURL | None:
        """The parsed ``remote_url`` (with ``KVLENS_REDIS_PASSWORD`` applied by ``load_config``)."""
        return self._remote

    @model_validator(mode="after")
    def _budgets_are_possible(self) -> KVLensConfig:
        if self.local_cpu and self.max_local_cpu_size <= 0:
            raise ValueError("max_local_cpu_size must be > 0 when local_cpu is true")
        if self.local_disk and self.max_local_disk_size <= 0:
            raise ValueError("max_local_disk_size must be > 0 when local_disk is set")
        if not self.local_cpu and not self.local_disk and not self.remote_url:
            raise ValueError("no storage tier: set local_cpu: true, local_disk or remote_url")
        return self

    @property
    def cpu_budget_bytes(self) -> int:
        return round(self.max_local_cpu_size * GB) if self.local_cpu else 0

    @property
    def disk_budget_bytes(self) -> int:
        return round(self.max_local_disk_size * GB) if self.local_disk else 0

    def tier_names(self) -> tuple[str, ...]:
        tiers = (("cpu", self.local_cpu), ("disk", bool(self.local_disk)), ("remote", bool(self.remote_url)))
        return tuple(name for name, on in tiers if on)

    def summary(self) -> dict[str, Any]:
        """The settings that differ from the defaults, for logs: no password ever."""
        out = self.model_dump(exclude_defaults=True)
        if self._remote is not None:
            out["remote_url"] = self._remote.redacted()
        return out

    @property
    def saves_partial_chunks(self) -> bool:
        return self.save_unfull_chunk and not self.discard_partial_chunks

    def check_block_size(self, block_size: int) -> None:
        if block_size <= 0 or self.chunk_size % block_size:
            raise ConfigError(
                f"KVLens config key 'chunk_size' = {self.chunk_size} must be a multiple of "
                f"vLLM's block size ({block_size})"
            )


def _key_of(name: str) -> str:
    return name.strip().lower()


def _parse_env_value(raw: str) -> Any:
    """Env values are strings; accept JSON/YAML scalars ("true", "256", "null", "{...}").

    A value YAML cannot turn into data stays a string, and validation names its key:
    ValueError is an integer past Python's int-to-str digit limit, RecursionError deep nesting.
    """
    try:
        return yaml.safe_load(raw)
    except (yaml.YAMLError, ValueError, RecursionError):
        return raw


def _from_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"LMCACHE_CONFIG_FILE={path!r} cannot be read: {e}") from e
    except (yaml.YAMLError, ValueError, RecursionError) as e:  # as in _parse_env_value
        raise ConfigError(f"LMCACHE_CONFIG_FILE={path!r} is not valid YAML: {str(e)[:200]}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"LMCACHE_CONFIG_FILE={path!r} must hold a mapping of keys")
    return {_key_of(str(k)): v for k, v in data.items()}  # "1: x" is an unknown key '1', named


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        key = name[len(ENV_PREFIX) :]
        if key in _ENV_NOT_KEYS:
            if key == "FORCE_SKIP_SAVE" and raw:
                out["force_skip_save"] = raw.strip().lower() not in ("0", "false", "no", "")
            continue
        out[_key_of(key)] = _parse_env_value(raw)
    return out


# vLLM-level extra_config keys (no "lmcache." prefix) that the seed reads.
_VLLM_LEVEL_KEYS = ("discard_partial_chunks", "skip_last_n_tokens")


def _from_extra(extra: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in _VLLM_LEVEL_KEYS:
        if key in extra:
            out[key] = extra[key]
    for name, value in extra.items():
        if isinstance(name, str) and name.startswith(EXTRA_PREFIX):
            out[_key_of(name[len(EXTRA_PREFIX) :])] = value
    return out


def _merge(*layers: dict[str, Any]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if key == "extra_config":
                if isinstance(value, str):
                    value = _parse_json_or_yaml(value)
                if isinstance(value, dict):
                    merged["extra_config"] = {**merged.get("extra_config", {}), **value}
                    continue
            elif key.startswith("extra_config."):
                sub = key[len("extra_config.") :]
                section = merged.setdefault("extra_config", {})
                if isinstance(section, dict):  # else validation names the non-mapping extra_config
                    section[sub] = value
                continue
            merged[key] = value
    return merged


def _parse_json_or_yaml(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _parse_env_value(text)


def _describe(error: ValidationError, sources: dict[str, str]) -> str:
    problems = []
    for item in error.errors():
        key = ".".join(str(p) for p in item["loc"]) or "config"
        origin = sources.get(key.split(".")[0], "")
        where = f" (from {origin})" if origin else ""
        problems.append(f"key '{key}'{where}: {item['msg']}")
    return "Invalid KVLens configuration: " + "; ".join(problems)


def load_config(
    extra_config: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> KVLensConfig:
    """Build the config from YAML, environment and vLLM's extra config, in that precedence."""
    env = os.environ if env is None else env
    yaml_layer = _from_yaml(env["LMCACHE_CONFIG_FILE"]) if env.get("LMCACHE_CONFIG_FILE") else {}
    env_layer = _from_env(env)
    extra_layer = _from_extra(extra_config or {})
    sources = {k: "LMCACHE_CONFIG_FILE" for k in yaml_layer}
    sources.update({k: f"env {ENV_PREFIX}{k.upper()}" for k in env_layer})
    sources.update({k: f"kv_connector_extra_config '{EXTRA_PREFIX}{k}'" for k in extra_layer})
    merged = _merge(yaml_layer, env_layer, extra_layer)
    ignored = sorted(k for k in merged if k in LMCACHE_KEYS_NOT_USED and k not in KVLensConfig.model_fields)
    if ignored:
        logger.warning(
            "KVLens ignores these LMCache settings (no such feature here): %s",
            ", ".join(f"{k} (from {sources.get(k, 'config')})" for k in ignored),
        )
        for k in ignored:
            merged.pop(k)
    try:
        config = KVLensConfig.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(_describe(e, sources)) from None
    if config.remote_url:
        config._remote = parse_remote_url(config.remote_url, environ=env)
    return config
