"""What every LMCache configuration key means to KVLens: used, accepted unused, or refused.

LMCache's own list (``lmcache/v1/config.py``, ``_CONFIG_DEFINITIONS`` and ``_CONFIG_ALIASES``)
plus keys older LMCache versions and its documentation use. A key here that KVLens has no use
for is accepted with one warning; a key that turns on an LMCache feature KVLens does not have,
and that changes what the engine does, stops start-up (``FEATURES``), unless it is set to its
"off" value. KVLens's own keys are the fields of ``KVLensConfig`` and ``ExtraConfig``.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

# LMCache's deprecated names -> current names (the current name decides what the key means).
ALIASES = {
    "enable_xpyd": "enable_pd",
    "nixl_peer_host": "pd_peer_host",
    "nixl_peer_init_port": "pd_peer_init_port",
    "nixl_peer_alloc_port": "pd_peer_alloc_port",
    "nixl_proxy_host": "pd_proxy_host",
    "nixl_proxy_port": "pd_proxy_port",
    "nixl_buffer_size": "pd_buffer_size",
    "nixl_role": "pd_role",
    "controller_url": "controller_pull_url",
    "lmcache_worker_port": "lmcache_worker_ports",
    "plugin_locations": "runtime_plugin_locations",
    "external_backends": "storage_plugins",
}

# Older LMCache names of keys KVLens reads -> the key they set (the value is read as the key's).
FIELD_ALIASES = {"blend_recompute_ratio": "blend_recompute_ratios"}

# LMCache keys KVLens has no use for -> what to use instead in KVLens ("" when nothing applies).
UNUSED: dict[str, str] = {
    **dict.fromkeys(
        """local_cpu_use_hugepages reserve_local_cpu_size local_disk_path_sharding retrieve_locations
        store_location p2p_host p2p_init_ports p2p_lookup_ports mp_host mp_port lmcache_instance_id
        controller_pull_url controller_reply_url lmcache_worker_ports lmcache_worker_ids
        lmcache_worker_heartbeat_delay_time lmcache_worker_heartbeat_time pd_role pd_buffer_size
        pd_buffer_device pd_peer_host pd_peer_init_port pd_peer_alloc_port pd_peer_query_port pd_proxy_host
        pd_proxy_port pd_allocation_timeout_sec pd_shutdown_timeout_sec pd_condition_poll_interval_sec
        pd_max_prefill_len pd_backend_mode pd_skip_proxy_notification pd_bidirectional transfer_channel
        nixl_backends nixl_buffer_device gds_path_sharding gds_buffer_size maru_pool_size use_gds gds_backend
        audit_actual_remote_url internal_api_server_host internal_api_server_enabled
        internal_api_server_port_start internal_api_server_include_index_list
        internal_api_server_socket_path_prefix py_enable_gc cost_aware_half_life_seconds
        cost_aware_ewma_alpha numa_mode runtime_plugin_locations hit_miss_ratio lookup_server_worker_ids
        enable_scheduler_bypass_lookup script_allowed_imports enable_lazy_memory_allocator
        lazy_memory_initial_ratio lazy_memory_expand_trigger_ratio lazy_memory_step_ratio
        lazy_memory_safe_size enable_chunk_statistics chunk_statistics_auto_start_statistics
        chunk_statistics_auto_exit_timeout_hours chunk_statistics_auto_exit_target_unique_chunks
        chunk_statistics_strategy enable_kv_events use_gpu_connector_v3 pin_check_interval_sec app_id
        max_hidden_state_cpu_size hidden_state_layers hidden_states_retrieve_mode""".split(),
        "",
    ),
    # Keys of LMCache's early versions (0.1-0.3: its v1 "experimental" switch, v0's error
    # handling flag), still in its benchmark and example configs.
    **dict.fromkeys(
        """use_experimental error_handling""".split(),
        "",
    ),
    "pre_caching_hash_algorithm": "KVLens keys chunks by BLAKE2b over the tokens and the model's identity",
    "blocking_timeout_secs": "extra_config.tier_timeout_s bounds a slow disk or remote read",
    "lookup_timeout_ms": "extra_config.remote_lookup_timeout_ms bounds a scheduler step's wait for a lookup",
    "pin_timeout_sec": "KVLens releases a request's pins when vLLM finishes or aborts it",
    # Older LMCache versions (0.1-0.3) and keys its documentation spells differently.
    **dict.fromkeys(
        """pipelined_backend lookup_url distributed_url persist_path max_local_cache_size cufile_buffer_size
        nixl_peer_port nixl_receiver_host nixl_receiver_port nixl_enable_gc peer_init_ports peer_lookup_ports
        blend_add_special_in_precomp pd_retrieve_locations pd_store_location disk_path""".split(),
        "",
    ),
    "blend_separator": "blend_special_str is the separator's text",
    "local_device": "local_cpu: true keeps KV in CPU memory; local_disk: <path> on disk",
}


@dataclass(frozen=True, slots=True)
class Feature:
    """An LMCache feature KVLens does not have; ``on(value)`` says whether a value turns it on."""

    name: str
    instead: str
    on: Callable[[Any], bool]


def lmcache_bool(value: Any) -> bool:
    """LMCache's ``_to_bool``: only ``true`` and ``1`` (any case, surrounding spaces) are true."""
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in ("true", "1")


def is_set(value: Any) -> bool:
    """A path, URL or list that is given (not null, not empty)."""
    return value not in (None, "", [], {}, ())


_PD = (
    "KVLens does not move KV from a prefill to a decode engine; use vLLM's NixlConnector for "
    "disaggregated prefill (KVLens can run beside it in a MultiConnector for offloading), or share "
    "KV through a common store (remote_url: redis://... or a shared local_disk) with kv_role kv_both"
)
_SHARE = (
    "share KV between engines through a common store: remote_url: redis://... (or valkey://, "
    "redis-cluster://, redis-sentinel://) or a local_disk on a filesystem both engines mount"
)

# LMCache keys that turn on a feature KVLens lacks: refused when on, accepted (unused) when off.
FEATURES: dict[str, Feature] = {
    "enable_pd": Feature("LMCache's disaggregated prefill (PD transfer over NIXL)", _PD, lmcache_bool),
    "enable_nixl": Feature("LMCache's NIXL KV transfer (an older form of PD)", _PD, lmcache_bool),
    "enable_p2p": Feature("P2P sharing of CPU-cached KV between engines", _SHARE, lmcache_bool),
    "enable_controller": Feature(
        "the LMCache controller (cache management over ZMQ)",
        "KVLens has no controller; its state is in the vllm:kvlens_* metrics and the KVLens dashboard",
        lmcache_bool,
    ),
    "enable_hidden_state_cache": Feature(
        "the hidden-state cache of vLLM-Omni pipelines",
        "none: remove enable_hidden_state_cache",
        lmcache_bool,
    ),
    "gds_path": Feature(
        "the GPU Direct Storage (GDS) backend", "local_disk: <path> for a disk tier (via CPU memory)", is_set
    ),
    "weka_path": Feature("the WekaFS GDS backend", "local_disk: <path on the Weka mount>", is_set),
    "maru_path": Feature("the Maru CXL shared-memory backend", "local_cpu or local_disk", is_set),
    "storage_plugins": Feature(
        "LMCache storage plugins (custom backends)", "local_cpu, local_disk or remote_url", is_set
    ),
    "remote_storage_plugins": Feature(
        "LMCache remote-storage plugins (custom remote connectors)", "remote_url: redis://...", is_set
    ),
    "external_lookup_client": Feature(
        "an external lookup service (e.g. Mooncake's)", "none: KVLens looks up its own tiers", is_set
    ),
    "remote_config_url": Feature(
        "fetching configuration from a remote service",
        "put the settings in the file LMCACHE_CONFIG_FILE names",
        is_set,
    ),
}

# extra_config entries that turn on an LMCache feature KVLens lacks.
EXTRA_FEATURES: dict[str, Feature] = {
    "enable_nixl_storage": Feature(
        "NIXL as a storage backend", "local_disk: <path> (or remote_url for a shared store)", lmcache_bool
    ),
}

# extra_config entries LMCache's documentation and examples use (accepted; the ones KVLens reads
# are fields of ExtraConfig). A name here is never "a typo of a KVLens key".
EXTRA_LMCACHE = frozenset(
    """use_odirect lookup_backoff_time save_only_first_rank first_rank_max_local_cpu_size
    p2p_socket_recv_timeout_ms p2p_socket_send_timeout_ms nixl_backend nixl_path nixl_pool_size
    nixl_presence_cache nixl_presence_cache_only nixl_use_hugepages audit_actual_remote_url
    gpu_to_numa_mapping cost_aware_half_life_seconds cost_aware_ewma_alpha local_hostname metadata_server
    protocol master_server_address global_segment_size local_buffer_size transfer_timeout device_name
    storage_root_dir s3_num_io_threads s3_prefer_http2 s3_region s3_enable_s3express aws_access_key_id
    aws_secret_access_key save_chunk_meta resp_num_threads valkey_num_workers valkey_ttl_sec
    ext_log_connector_support_ping ext_log_connector_health_interval ext_log_connector_stuck_time""".split()
)
EXTRA_LMCACHE_PREFIXES = ("histogram_bucket_", "plugin.", "remote_storage_plugin.", "p2p_", "s3_", "nixl_")

# Remote URL schemes of LMCache backends KVLens does not speak (its remote tier is Redis).
REMOTE_BACKENDS = {
    "lm": "the LMCache server",
    "infinistore": "InfiniStore",
    "mooncakestore": "Mooncake Store",
    "s3": "S3",
    "fs": "LMCache's filesystem connector",
    "blackhole": "LMCache's blackhole test backend",
    "audit": "LMCache's audit connector",
    "mock": "LMCache's mock backend",
    "benchmark": "LMCache's benchmark backend",
    "external": "an external LMCache connector",
    "azure": "Azure Blob Storage",
    "gcs": "Google Cloud Storage",
    "gs": "Google Cloud Storage",
    "bigtable": "Bigtable",
    "couchbase": "Couchbase",
    "eic": "EIC",
    "hf3fs": "3FS",
    "3fs": "3FS",
    "hfbucket": "a Hugging Face bucket",
    "shmfile": "LMCache's shared-memory file connector",
    "sagemaker-hyperpod": "SageMaker HyperPod",
    "valkey-sync": "LMCache's GLIDE Valkey connector",
}


def canonical(key: str) -> str:
    return ALIASES.get(key, key)


def lmcache_knows(key: str) -> bool:
    """Whether ``key`` is an LMCache configuration key (current, deprecated or older)."""
    key = canonical(key)
    return key in UNUSED or key in FEATURES or key in FIELD_ALIASES


def extra_lmcache_knows(key: str) -> bool:
    return key in EXTRA_LMCACHE or key in EXTRA_FEATURES or key.startswith(EXTRA_LMCACHE_PREFIXES)


def nearest(key: str, known: Iterable[str], cutoff: float = 0.75) -> str | None:
    """The known name closest to ``key`` (a typo's likely meaning), if any is close."""
    found = difflib.get_close_matches(key, list(known), n=1, cutoff=cutoff)
    return found[0] if found else None
