"""The validated shape of KVLens's configuration: every key KVLens honours, its type and default.

``config.py`` reads the sources and ``config_rules.py`` decides what each LMCache key means;
this module only says what a valid configuration is.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ..engine.eviction import POLICIES
from ..tiers.remote_url import RemoteURL
from .blend import DEFAULT_SEPARATOR, BlendSettings, CheckLayers, Ratios, Separator, Thresholds
from .pd import PDConfig

GB = 1024**3
MB = 1024**2


class ConfigError(ValueError):
    """A configuration problem, raised once at start-up with the offending key named."""


class ExtraConfig(BaseModel):
    """The ``extra_config`` dict: KVLens's own knobs and the LMCache entries KVLens reads."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    # Report {"num_lmcache_cached_tokens": N} in each response's kv_transfer_params.
    enable_cache_usage_details_in_response: bool = True
    # Also store a prompt's unfull last chunk cut to whole vLLM blocks, and let lookups take
    # the longest stored whole-block prefix of a chunk: hits at block, not chunk, granularity.
    block_granular_tails: bool = True
    # How often the scheduler rescans the disk tier for chunks written by other engines.
    disk_scan_interval_s: float = Field(1.0, gt=0)
    # Bytes per second the disk tier's background scrub reads to verify records (0: no walk;
    # records written with one a load found damaged are still verified at once).
    disk_scrub_bytes_per_s: int = Field(4 * MB, ge=0)
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
    # Load a chunk only when its tier (as measured) loads it faster than the engine (as
    # measured) computes its tokens; false: load whatever is found.
    load_only_if_faster: bool = True
    # With enable_async_loading, a disk load still runs inside the step when no other request
    # is in the engine and the load is predicted (as measured) to take at most this long:
    # nobody waits for it, and the request saves an asynchronous load's step round trip.
    # Remote loads are always asynchronous. 0: disk loads are too.
    async_load_in_step_max_ms: float = Field(50.0, ge=0)
    # The admin endpoint (connector/scheduler/admin.py; `kvlens clear` of a running server): off unless a
    # port is set; data-parallel engine i listens on admin_port + i.
    admin_port: int | None = Field(None, ge=1, le=65535)
    admin_host: str = "127.0.0.1"  # keep it on loopback unless fenced off
    # Its bearer token (connector/scheduler/admin_token.py): this literal, or the file named here (written
    # with a random token, 0600, if missing). Neither: a random token per start, written 0600 to
    # ~/.cache/kvlens/admin-<port>.token, where `kvlens` on the same host reads it.
    admin_token: SecretStr | None = Field(None, min_length=16)
    admin_token_file: str | None = Field(None, min_length=1)
    # LMCache's tag_keys: names of kv_transfer_params entries whose values become key tags, as
    # if sent as lmcache.tag.<name> (requests with other values never share KV).
    tag_keys: tuple[str, ...] = ()
    # Tenants (cache salt and tags) shown under their own label in the per-tenant metrics: the
    # first this many seen; later ones are counted under "other" (bounded label cardinality).
    tenant_labels_max: int = Field(10, ge=0, le=100)
    # ---- tenants (issue 26 items 15, 16: keep together) ----
    # The key tenant ids on /metrics are computed with (engine/tenants.py): a secret of 16 or
    # more characters, or a file holding one; unset, one is generated and kept with the cache.
    tenant_id_key: SecretStr | None = None
    tenant_id_key_file: str | None = Field(None, min_length=1)
    # Client-sized state: a request whose cache salt or tag value is longer, or with more tags,
    # is served without KVLens (miss reason invalid_params), counted in tenant_refusals_total.
    cache_salt_max_chars: int = Field(256, ge=1, le=65536)
    tag_value_max_chars: int = Field(256, ge=1, le=65536)
    tags_max: int = Field(8, ge=1, le=64)
    # Namespaces (salt, tags, LoRA) the scheduler remembers for labels and miss explanations;
    # beyond, the least recently used are forgotten (labels) or new ones not noted (explanations).
    namespaces_max: int = Field(4096, ge=1, le=1_000_000)
    # ---- end tenants ----
    # Retention (kv_transfer_params kvlens.retention_priority / kvlens.retain_for_s): the share of
    # each CPU or disk tier's budget retained chunks may hold; beyond it the lowest become normal.
    max_retained_share: float = Field(0.5, ge=0, le=1)
    # Optional byte budget per tenant (cache salt and key tags) and tier, e.g. {cpu: 1073741824}:
    # a tenant at its quota evicts its own chunks to store more, never another's. Off by default.
    tenant_quota_bytes: tuple[tuple[Literal["cpu", "disk"], Annotated[int, Field(gt=0)]], ...] = ()
    # Who may ask for retention (connector/engine/retention_rules.py): tenant ids as the metrics
    # show them (default, salt:3fa1c2d90b, ...), tags as NAME=VALUE, or "*" for every request.
    # Empty (the default): nobody; a request's ask is ignored and counted. What an allowed
    # request gets is capped: priority, seconds (an ask without an end gets this end) and, per
    # tenant, the share of each CPU or disk tier's budget its retained chunks may hold.
    retention_allowed: tuple[str, ...] = ()
    retention_max_priority: int = Field(3, ge=0, le=3)
    retention_max_seconds: float = Field(86400.0, gt=0, le=30 * 86400)
    max_retained_share_per_tenant: float = Field(0.25, ge=0, le=1)
    # LMCache's Valkey settings, for valkey:// and valkeys:// URLs.
    valkey_username: str | None = None
    valkey_password: SecretStr | None = None
    valkey_database: int | None = Field(None, ge=0)
    valkey_mode: Literal["standalone", "cluster"] = "standalone"
    # LMCache's RESP connector credentials, for resp:// URLs.
    username: str | None = None
    password: SecretStr | None = None
    # Shared stores (local_disk, remote_url): a secret (16 characters or more) that tags every
    # record this engine writes, and that every record it reads must be tagged with (keyed
    # BLAKE3 over the header, BLAKE3 digests of the payload); a record without a valid tag
    # (written without the key, with another, or under another chunk's name) is refused as
    # corrupt, counted, deleted and recomputed. Or the path of a file holding it, or the
    # environment variable KVLENS_STORE_AUTH_KEY (when neither is set).
    store_auth_key: SecretStr | None = None
    store_auth_key_file: str | None = Field(None, min_length=1)

    @field_validator("tag_keys", mode="before")
    @classmethod
    def _tag_keys_are_names(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) and v for v in value):
            raise ValueError("must be a list of kv_transfer_params names, e.g. [user]")
        return value

    @field_validator("retention_allowed", mode="before")
    @classmethod
    def _retention_allowed_entries(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) and v.strip() for v in value):
            raise ValueError(
                'must be a list of tenant ids, NAME=VALUE tags or "*", e.g. [default, team=blue]'
            )
        return tuple(v.strip() for v in value)

    @model_validator(mode="after")
    def _one_admin_token(self) -> ExtraConfig:
        if self.admin_token is not None and self.admin_token_file:
            raise ValueError("set admin_token or admin_token_file, not both")
        return self

    @field_validator("tenant_quota_bytes", mode="before")
    @classmethod
    def _quota_per_tier(cls, value: Any) -> Any:
        if isinstance(value, tuple | list) and all(isinstance(p, tuple | list) for p in value):
            return value  # already pairs (a dumped config read back)
        if not isinstance(value, dict):
            raise ValueError("must map a tier to bytes, e.g. {cpu: 1073741824}")
        return tuple(value.items())

    @field_validator("tenant_id_key")
    @classmethod
    def _tenant_id_key_is_long(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 16:
            raise ValueError("must be 16 or more characters (a secret, not a name)")
        return value

    def tenant_quota(self, tier: str) -> int | None:
        """A tenant's byte budget in ``tier`` (None: no quota)."""
        return dict(self.tenant_quota_bytes).get(tier)  # type: ignore[arg-type]

    @model_validator(mode="after")
    def _one_store_auth_key(self) -> ExtraConfig:
        if self.store_auth_key is not None and self.store_auth_key_file is not None:
            raise ValueError("set store_auth_key or store_auth_key_file, not both")
        if self.store_auth_key is not None and len(self.store_auth_key.get_secret_value()) < 16:
            raise ValueError("store_auth_key must be at least 16 characters")
        return self

    @field_validator("valkey_mode", mode="before")
    @classmethod
    def _mode_in_any_case(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value


class KVLensConfig(BaseModel):
    """Every setting KVLens honours. Unknown keys and wrong types are start-up errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    chunk_size: int = Field(256, gt=0)
    local_cpu: bool = True
    max_local_cpu_size: float = Field(5.0, ge=0)  # GB
    local_disk: str | None = None
    max_local_disk_size: float = Field(0.0, ge=0)  # GB
    remote_url: str | None = None
    # How KV is serialized in the remote store: as-is (LMCache's naive; null means the same).
    remote_serde: Literal["naive"] | None = "naive"
    # Which unpinned chunk a full CPU or disk tier evicts first: LRU, LFU, FIFO or MRU (any case).
    cache_policy: str = "LRU"
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
    # Chunks found on the disk or remote tier load outside the step: the request waits while the
    # batch goes on (CPU-tier hits stay in the step). On by default, unlike LMCache: a slow
    # tier never stalls the running requests, and a failed load is known before the request
    # computes anything over its blocks.
    enable_async_loading: bool = True
    # CacheBlend (docs/blending.md): reuse documents' KV wherever they sit in a prompt, split at
    # blend_special_str. Read and checked; ``enable_blending: true`` is refused until the blender
    # exists (rules.py). Unset lists mean LMCache's example: check layer 1, recompute 15%.
    enable_blending: bool = False
    blend_special_str: Separator = DEFAULT_SEPARATOR
    blend_recompute_ratios: Ratios = None  # shares of reused tokens recomputed, per check layer
    blend_check_layers: CheckLayers = None  # layers whose K deviation picks the tokens to recompute
    blend_thresholds: Thresholds = None  # K deviations above which a token is recomputed
    blend_min_tokens: int = Field(256, ge=0)  # shorter segments are computed, never reused
    extra_config: ExtraConfig = ExtraConfig()
    _remote: RemoteURL | None = PrivateAttr(None)
    _store_auth_key: bytes | None = PrivateAttr(None)
    _unused: tuple[str, ...] = PrivateAttr(())
    _pd: PDConfig = PrivateAttr(default_factory=PDConfig)

    @field_validator("local_disk")
    @classmethod
    def _strip_file_scheme(cls, value: str | None) -> str | None:
        if value and value.startswith("file://"):
            value = value[len("file://") :]
        return value or None

    @field_validator("remote_url")
    @classmethod
    def _no_empty_url(cls, value: str | None) -> str | None:
        return value or None

    @field_validator("cache_policy", mode="before")
    @classmethod
    def _policy_in_any_case(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().upper() in POLICIES:
            return value.strip().upper()
        raise ValueError(f"must be one of {', '.join(POLICIES)} (any case)")

    @property
    def remote(self) -> RemoteURL | None:
        """The parsed ``remote_url`` with credentials and modes from ``extra_config`` applied."""
        return self._remote

    @property
    def store_auth_key(self) -> bytes | None:
        """The shared stores' key (``extra_config.store_auth_key``, its file or environment
        variable), or None: records are neither tagged nor required to be."""
        return self._store_auth_key

    @property
    def unused_settings(self) -> tuple[str, ...]:
        """LMCache settings accepted at load and not used, each with where it came from."""
        return self._unused

    @property
    def pd(self) -> PDConfig:
        """Prefill/decode disaggregation: off, a prefiller (sender) or a decoder (receiver)."""
        return self._pd

    @model_validator(mode="after")
    def _budgets_are_possible(self, info: ValidationInfo) -> KVLensConfig:
        if self.local_cpu and self.max_local_cpu_size <= 0:
            raise ValueError("max_local_cpu_size must be > 0 when local_cpu is true")
        if self.local_disk and self.max_local_disk_size <= 0:
            raise ValueError("max_local_disk_size must be > 0 when local_disk is set")
        pd = bool(info.context and info.context.get("pd"))
        if not self.local_cpu and not self.local_disk and not self.remote_url and not pd:
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
        out = self.model_dump(
            exclude_defaults=True,
            exclude={
                "remote_url": True,
                "extra_config": {"valkey_password", "password", "store_auth_key", "admin_token"},
            },
        )
        if self._remote is not None:
            out["remote_url"] = self._remote.redacted()
        return out

    @property
    def blend(self) -> BlendSettings:
        """The blend settings with LMCache's example defaults filled in, one value per check layer."""
        return BlendSettings.of(
            self.blend_special_str,
            self.blend_check_layers,
            self.blend_recompute_ratios,
            self.blend_thresholds,
            self.blend_min_tokens,
        )

    @property
    def saves_partial_chunks(self) -> bool:
        return self.save_unfull_chunk and not self.discard_partial_chunks

    def check_block_size(self, block_size: int) -> None:
        if block_size <= 0 or self.chunk_size % block_size:
            raise ConfigError(
                f"KVLens config key 'chunk_size' = {self.chunk_size} must be a multiple of "
                f"vLLM's block size ({block_size})"
            )
