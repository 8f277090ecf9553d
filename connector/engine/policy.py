"""Per-request decisions that depend only on the request: namespace, save policy, misses."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .keys import Namespace, parse_tags
from .outcomes import MissReason, SaveSkipReason
from .retention import PARAMS as RETENTION_PARAMS
from .retention import Retention, parse_retention
from .retention_rules import RetentionRules
from .tenants import TenantLimits, refusal, tenant_id

logger = logging.getLogger("vllm.kvlens")


@dataclass(frozen=True, slots=True)
class RequestPolicy:
    """What KVLens may do for one request, decided once when it first arrives."""

    namespace: Namespace | None  # None: KVLens neither loads nor stores for this request
    skip_reason: MissReason | None  # why nothing is loaded or stored, when namespace is None
    save_skip_reason: SaveSkipReason | None  # why nothing is stored (loads may still happen)
    ignored_params: int = 0  # lmcache.* / kvlens.* request parameters ignored (unknown or invalid)
    retention: Retention | None = None  # what the operator grants of the request's ask
    # whose quota and retention cap its chunks count against: its tenant id here, its bounded
    # label (tenants.TenantBook: beyond tenant_labels_max, one shared "other") in the scheduler
    tenant: str = "default"
    retention_refused: str | None = None  # why it got less retention than it asked (retention_rules)
    tenant_refused: str | None = None  # why its salt or tags were refused (tenants.REFUSAL_REASONS)


def _bool_param(params: Mapping[str, Any], name: str) -> bool:
    value = params.get(name, False)
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError(f"{name} must be a boolean, got {type(value).__name__}")


_KNOWN_PARAMS = frozenset({"lmcache.skip_save"}) | RETENTION_PARAMS
_TAG_PREFIX = "lmcache.tag."
_warned_params: set[str] = set()  # names already logged (bounded below)
_warned_refusals: set[str] = set()  # refusal reasons already logged (once each)
_DEFAULT_LIMITS = TenantLimits()


def unknown_params(params: Mapping[Any, Any]) -> int:
    """How many ``lmcache.*`` and ``kvlens.*`` keys KVLens does not know; each new name is logged
    once (a typo such as ``lmcache.tags.user`` would otherwise silently share KV). The request is
    served as usual."""
    unknown = [
        k
        for k in params
        if isinstance(k, str)
        and k.startswith(("lmcache.", "kvlens."))
        and k not in _KNOWN_PARAMS
        and not k.startswith(_TAG_PREFIX)
    ]
    for name in unknown:
        if name not in _warned_params and len(_warned_params) < 256:
            _warned_params.add(name)
            logger.warning("KVLens: request parameter %r is not one KVLens knows; ignored", name[:80])
    return len(unknown)


def request_tags(params: Mapping[str, Any], tag_keys: Sequence[str] = ()) -> dict[str, str]:
    """The request's key tags: ``lmcache.tag.<name>`` entries, and (LMCache's ``tag_keys``) the
    entries named in ``tag_keys`` whose value is set, as the tag of the same name. Empty values
    make no tag, as in LMCache; one name with two different values is an error."""
    tags = parse_tags(params)
    for name in tag_keys:
        value = params.get(name)
        if not value:
            continue
        if not isinstance(value, (str, int)) or isinstance(value, bool):
            raise ValueError(f"{name} (a tag_keys entry) must be a string, got {type(value).__name__}")
        if tags.get(name, str(value)) != str(value):
            raise ValueError(
                f"tag {name!r} is given twice with different values ({name} and lmcache.tag.{name})"
            )
        tags[name] = str(value)
    return tags


def decide_policy(
    base: Namespace,
    request_id: str,
    kv_transfer_params: Mapping[str, Any] | None,
    lora_name: str | None,
    cache_salt: str | None,
    priority: int,
    has_unsupported_input: bool,
    kv_role: str,
    priority_limit: int | None,
    force_skip_save: bool,
    tag_keys: Sequence[str] = (),
    retention_rules: RetentionRules | None = None,
    limits: TenantLimits = _DEFAULT_LIMITS,
) -> RequestPolicy:
    """``retention_rules`` None: the request's retention ask is taken as it is."""
    if has_unsupported_input:
        return RequestPolicy(None, MissReason.UNSUPPORTED_INPUT, SaveSkipReason.UNSUPPORTED_INPUT)
    params = kv_transfer_params if isinstance(kv_transfer_params, Mapping) else {}
    try:
        tags = request_tags(params, tag_keys)
        skip_save = _bool_param(params, "lmcache.skip_save")
    except ValueError as e:
        # Ignoring a tag could share KV across the boundary the tag draws, so the
        # request is served without KVLens instead.
        logger.warning("KVLens: request %s: %s; not caching this request", request_id, e)
        return RequestPolicy(None, MissReason.INVALID_PARAMS, SaveSkipReason.INVALID_PARAMS)
    over_bound = refusal(cache_salt, tags, limits)
    if over_bound is not None:  # client-sized state: served without KVLens, counted by the caller
        if over_bound not in _warned_refusals:
            _warned_refusals.add(over_bound)
            logger.warning(
                "KVLens: request %s: %s (bounds: %s); not caching it", request_id, over_bound, limits
            )
        return RequestPolicy(
            None, MissReason.INVALID_PARAMS, SaveSkipReason.INVALID_PARAMS, tenant_refused=over_bound
        )
    ignored = unknown_params(params)
    try:
        retention = parse_retention(params)
    except ValueError as e:  # only how long the chunks stay is at stake: serve it without retention
        logger.warning("KVLens: request %s: %s; storing without retention", request_id, e)
        retention, ignored = None, ignored + 1
    namespace = base.with_request(lora_name, cache_salt, tags)
    tenant, refused = tenant_id(namespace), None
    if retention_rules is not None:
        retention, refused = retention_rules.grant(retention, tenant, tags)
    save_skip: SaveSkipReason | None = None
    if kv_role == "kv_consumer":
        save_skip = SaveSkipReason.CONSUMER_ROLE
    elif force_skip_save:
        save_skip = SaveSkipReason.FORCE_SKIP_SAVE
    elif skip_save:
        save_skip = SaveSkipReason.SKIP_SAVE
    elif priority_limit is not None and priority > priority_limit:
        save_skip = SaveSkipReason.PRIORITY_LIMIT
    return RequestPolicy(namespace, None, save_skip, ignored, retention, tenant, refused)


def miss_reason(
    num_tokens_looked_up: int,
    hit_tokens: int,
    vllm_cached: int,
    first_missing: str | None,
    recently_evicted: RecentlyEvicted,
    unanswered: MissReason | None = None,
) -> MissReason | None:
    """Why KVLens did not supply (more of) the prompt; None when it supplied all it could.
    ``unanswered``: why the tier that would hold the next chunk could not say whether it does
    (``tier_unhealthy``: skipped; ``lookup_timeout``: the remote did not answer in time)."""
    if hit_tokens >= num_tokens_looked_up:
        return None
    if unanswered is not None:
        return unanswered
    if first_missing is None:  # no chunk boundary left: only an unfull tail remains
        return MissReason.PARTIAL_CHUNK
    if first_missing in recently_evicted:
        return MissReason.EVICTED
    if hit_tokens and hit_tokens <= vllm_cached:
        return MissReason.VLLM_HIT
    return MissReason.NOT_STORED


class RecentlyEvicted:
    """A bounded memory of evicted chunk names, to tell 'evicted' from 'never stored' and say
    from which tier and when (a chunk evicted from several tiers keeps the last)."""

    def __init__(self, capacity: int = 65536, clock: Callable[[], float] = time.monotonic) -> None:
        self._names: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._capacity = capacity
        self._clock = clock

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def add(self, names: Iterable[str], tier: str) -> None:
        now = self._clock()
        for name in names:
            self._names[name] = (tier, now)
            self._names.move_to_end(name)
        while len(self._names) > self._capacity:
            self._names.popitem(last=False)

    def discard(self, name: str) -> None:
        self._names.pop(name, None)

    def detail(self, name: str) -> dict[str, Any] | None:
        """``{"tier": ..., "evicted_s_ago": ...}`` for a remembered chunk, else None."""
        seen = self._names.get(name)
        if seen is None:
            return None
        return {"tier": seen[0], "evicted_s_ago": round(max(self._clock() - seen[1], 0.0), 1)}


def trace_headers(request: Any) -> dict[str, str] | None:
    """The request's W3C trace headers (vLLM keeps them only when it traces)."""
    headers = getattr(request, "trace_headers", None)
    if not headers:
        return None
    kept = {k: v for k, v in headers.items() if k in ("traceparent", "tracestate")}
    return kept or None
