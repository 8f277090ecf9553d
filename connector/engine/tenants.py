"""Per-tenant accounting: hit ratio, tokens loaded and bytes held, by tenant.

A tenant is what separates one group of requests' KV from another's: the cache salt and the
key tags (``lmcache.tag.<name>``, ``tag_keys``) of the request's namespace. Requests with
neither belong to ``default``. A tenant is shown by an id that never carries a salt or a tag
value: each is replaced by 64 bits of a BLAKE2b keyed with the deployment's secret
(``salt:3fa1c2d90b7e4f01``, ``user:9e2a41c07d5b3a88``); tag names, which the operator chooses,
are kept. The key (``connector/scheduler/tenant_id_key.py``: configured, or generated once and kept with
the cache) is what makes an id on an unauthenticated ``/metrics`` reveal nothing: without it,
a guessed salt cannot be confirmed by hashing it. Instances that share a cache share the key,
so they count a tenant under one id.

Label cardinality is bounded, and counters stay monotonic per label, by giving a tenant its
own label on first sight while fewer than ``max_labels`` tenants have one; every later
tenant is counted under ``other`` for the engine's lifetime. A label never moves, so no
series flaps between scrapes and no counter ever goes back; the price is that the first
tenants keep their labels (restart the engine, or raise ``tenant_labels_max``, to re-rank).

What clients size is bounded: a request whose cache salt or tag (name or value) is longer
than its bound, or that carries more tags than ``tags_max``, is served without KVLens and its
refusal counted (``refusal``, ``REFUSAL_REASONS``); the namespaces remembered for labels are the
``namespaces_max`` most recently seen (a forgotten one gets its label back from its id).

Bytes held follow the scheduler's index: a chunk this engine admits to a tier is its
tenant's until the tier drops it (evicted, removed, cleared). A chunk's key depends on the
namespace, so each chunk belongs to exactly one tenant. Chunks another engine wrote to a
shared disk directory are nobody's here.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

from .keys import Namespace

DEFAULT = "default"  # neither a cache salt nor a tag
OTHER = "other"  # tenants beyond the first max_labels
_ID_HEX = 16  # 64 bits: no two of the tenants a deployment sees share an id in practice
_NAME = re.compile(r"[^A-Za-z0-9_.-]")
_MAX_NAME = 32
_MAX_OPEN = 100_000  # requests whose tenant is remembered until their load is reported


@dataclass(frozen=True, slots=True)
class TenantIds:
    """Tenant ids under one deployment's key (at least 16 bytes, never shown)."""

    key: bytes = field(repr=False)

    def value_id(self, value: str) -> str:
        """A salt's or tag value's id: keyed BLAKE2b, so it names no value, cannot be undone, and
        cannot be recomputed from a guess without the key."""
        return hashlib.blake2b(value.encode(), digest_size=_ID_HEX // 2, key=self.key[:64]).hexdigest()

    def tenant_id(self, namespace: Namespace | None) -> str:
        """The tenant of a request's namespace: ``default``, or its salt and tags as ids."""
        if namespace is None or (namespace.cache_salt is None and not namespace.tags):
            return DEFAULT
        parts = [] if namespace.cache_salt is None else [f"salt:{self.value_id(namespace.cache_salt)}"]
        parts += [f"{_NAME.sub('_', name)[:_MAX_NAME]}:{self.value_id(v)}" for name, v in namespace.tags]
        return ",".join(parts)


REFUSAL_REASONS = ("salt_too_long", "tag_too_long", "too_many_tags", "namespaces_full")


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """Bounds on what a request may make the scheduler keep (extra_config's)."""

    salt_chars: int = 256  # cache_salt_max_chars
    tag_chars: int = 256  # tag_value_max_chars: a tag's name and its value each
    tags: int = 8  # tags_max


def refusal(cache_salt: str | None, tags: Mapping[str, str], limits: TenantLimits) -> str | None:
    """Why a request's salt or tags are refused (one of ``REFUSAL_REASONS``), or None."""
    if cache_salt is not None and len(cache_salt) > limits.salt_chars:
        return "salt_too_long"
    if len(tags) > limits.tags:
        return "too_many_tags"
    if any(len(name) > limits.tag_chars or len(value) > limits.tag_chars for name, value in tags.items()):
        return "tag_too_long"
    return None


# Until the scheduler sets the deployment's key, a key of this process alone: an id is never
# computed under a key anyone else knows.
_deployment = TenantIds(os.urandom(32))


def use_deployment_key(key: bytes) -> None:
    """Compute every later ``tenant_id`` under ``key`` (the scheduler does, at start)."""
    global _deployment
    if len(key) < 16:
        raise ValueError("a tenant id key must be at least 16 bytes")
    _deployment = TenantIds(bytes(key))


def value_id(value: str) -> str:
    """A salt's or tag value's id under the deployment's key (``TenantIds.value_id``)."""
    return _deployment.value_id(value)


def tenant_id(namespace: Namespace | None) -> str:
    """The tenant of a request's namespace under the deployment's key (``TenantIds.tenant_id``)."""
    return _deployment.tenant_id(namespace)


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """What the tenants did since the last ``take`` (counters) and hold now (gauges), by label."""

    lookup_tokens: Mapping[str, int]  # prompt tokens looked up
    hit_tokens: Mapping[str, int]  # of those, tokens KVLens held (num_lmcache_cached_tokens)
    load_tokens: Mapping[str, int]  # tokens KVLens loaded into vLLM
    bytes_held: Mapping[tuple[str, str], int]  # (label, tier) -> bytes (one rank's share); 0 kept
    refusals: Mapping[str, int] = field(default_factory=dict)  # reason -> requests or notes refused
    blend_tokens: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (label, kind) -> tokens


class TenantBook:
    """Labels, counters and bytes held per tenant, for the scheduler half (no I/O, no vLLM)."""

    def __init__(self, max_labels: int, tiers: tuple[str, ...] = (), max_namespaces: int = 4096) -> None:
        self.max_labels = max_labels
        self._labels: dict[str, str] = {DEFAULT: DEFAULT}  # tenant id -> its label
        self._own = 0  # tenants given their own label
        self._max_namespaces = max_namespaces
        self._by_namespace: OrderedDict[Namespace | None, str] = OrderedDict()  # most recent last
        self._requests: OrderedDict[str, str] = OrderedDict()  # request id -> label
        self._chunks: dict[tuple[str, str], tuple[str, int]] = {}  # (tier, chunk) -> (label, bytes)
        self._bytes: dict[tuple[str, str], int] = {(label, t): 0 for label in (DEFAULT, OTHER) for t in tiers}
        self._lookup: dict[str, int] = {}
        self._hit: dict[str, int] = {}
        self._load: dict[str, int] = {}
        self._refused: dict[str, int] = {}
        self._blend: dict[tuple[str, str], int] = {}

    # ---- labels ---------------------------------------------------------------------------
    def label(self, namespace: Namespace | None) -> str:
        """The label a namespace's tenant is counted under (assigned once, never moved)."""
        label = self._by_namespace.get(namespace)
        if label is None:
            label = self._by_namespace[namespace] = self._label_of(tenant_id(namespace))
            if len(self._by_namespace) > self._max_namespaces:
                self._by_namespace.popitem(last=False)
        else:
            self._by_namespace.move_to_end(namespace)
        return label

    def _label_of(self, tenant: str) -> str:
        label = self._labels.get(tenant)
        if label is not None:
            return label
        if self._own >= self.max_labels:
            return OTHER  # not remembered: the set of tenants seen stays bounded
        self._own += 1
        self._labels[tenant] = tenant
        return tenant

    def labels(self) -> list[str]:
        """Every label in use: default, the tenants', and other."""
        return [*self._labels, OTHER]

    # ---- requests -------------------------------------------------------------------------
    def open(self, request_id: str, namespace: Namespace | None) -> str:
        """The request's label, remembered until ``close`` (its load may be reported late)."""
        label = self._requests.get(request_id)
        if label is None:
            label = self._requests[request_id] = self.label(namespace)
            if len(self._requests) > _MAX_OPEN:
                self._requests.popitem(last=False)
        return label

    def request_label(self, request_id: str) -> str:
        return self._requests.get(request_id, DEFAULT)

    def close(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def looked_up(self, request_id: str, prompt_tokens: int, hit_tokens: int) -> None:
        """A request's final lookup (a preempted request's second lookup is not counted)."""
        label = self.request_label(request_id)
        self._lookup[label] = self._lookup.get(label, 0) + prompt_tokens
        self._hit[label] = self._hit.get(label, 0) + hit_tokens

    def loaded(self, request_id: str, tokens: int) -> None:
        if tokens:
            label = self.request_label(request_id)
            self._load[label] = self._load.get(label, 0) + tokens

    def blended(self, label: str, reused: int, recomputed: int) -> None:
        """A blend's prompt tokens for a request counted under ``label`` (taken when its blend
        was planned: the report may come after the request ended)."""
        for kind, n in (("reused", reused), ("recomputed", recomputed)):
            self._blend[(label, kind)] = self._blend.get((label, kind), 0) + n

    def refused(self, reason: str) -> None:
        """A request's salt or tags, or a namespace to remember, refused (``REFUSAL_REASONS``)."""
        self._refused[reason] = self._refused.get(reason, 0) + 1

    # ---- bytes held -----------------------------------------------------------------------
    def held(self, tier: str, chunk: str, label: str, nbytes: int) -> None:
        """``tier`` admitted ``chunk`` for a request counted under ``label``."""
        key = (tier, chunk)
        if key in self._chunks:
            self.dropped(tier, chunk)
        self._chunks[key] = (label, nbytes)
        self._bytes[(label, tier)] = self._bytes.get((label, tier), 0) + nbytes

    def dropped(self, tier: str, chunk: str) -> None:
        """``tier`` no longer holds ``chunk`` (a chunk this engine did not admit is ignored)."""
        gone = self._chunks.pop((tier, chunk), None)
        if gone is not None:
            label, nbytes = gone
            self._bytes[(label, tier)] -= nbytes

    def bytes_held(self, label: str, tier: str) -> int:
        return self._bytes.get((label, tier), 0)

    def take(self) -> TenantUsage:
        """Counters since the last call, and the bytes every label holds now."""
        bytes_held = dict(self._bytes)
        usage = TenantUsage(self._lookup, self._hit, self._load, bytes_held, self._refused, self._blend)
        self._lookup, self._hit, self._load, self._refused, self._blend = {}, {}, {}, {}, {}
        return usage
