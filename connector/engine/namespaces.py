"""Telling "never stored" from "stored under another namespace" (the "two instances never
share" case): a bounded memory of which namespaces stored a prompt's first chunk.

A chunk's key covers the namespace (model, dtype, KV layout, parallel size, LoRA, cache salt,
tags), so a prompt stored under one namespace is simply absent under another. To explain such
a miss, the scheduler notes, for every request that stores, a namespace-free fingerprint of
its first chunk's tokens (``keys.first_chunk_fingerprint``) and the namespace it stores under.
A lookup whose first chunk is missing asks whether another namespace stored those tokens, and
which parts of the namespace differ (names only: a cache salt or a tag value is never
reported). Pure logic.

What a *client* is told never depends on another tenant's prompts (a tenant: a cache salt and
key tags, ``tenants.py``): its response reads ``other_namespace`` only when a namespace of its
own tenant stored the prompt (another model, LoRA or parallel size), and ``not_stored``
otherwise (``client_miss_reason``). So the memory is kept per tenant: one tenant's entries never
push out another's for the same prompt, and a lookup finds its own tenant's namespace first.
The operator's views (the request log, the app, spans) still name a namespace of another tenant
when no namespace of the request's own tenant stored the prompt.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from .keys import Namespace
from .outcomes import MissReason

TENANT_PARTS = frozenset({"cache_salt", "tags"})  # the parts of a namespace that make its tenant
Tenant = tuple[str | None, tuple[tuple[str, str], ...]]  # (cache salt, tags)


def tenant_of(namespace: Namespace) -> Tenant:
    return (namespace.cache_salt, namespace.tags)


def client_miss_reason(reason: MissReason | None, detail: Mapping[str, Any] | None) -> MissReason | None:
    """The miss reason a client may see: a prompt stored only under another tenant's namespace
    reads ``not_stored``, as if no one had stored it."""
    if reason is MissReason.OTHER_NAMESPACE and TENANT_PARTS & set((detail or {}).get("differs_in", ())):
        return MissReason.NOT_STORED
    return reason


def namespace_differences(mine: Namespace, other: Namespace) -> list[str]:
    """The names of the namespace parts that differ (model, dtype, kv_layout, lora, ...)."""
    return [f.name for f in fields(Namespace) if getattr(mine, f.name) != getattr(other, f.name)]


class FirstChunkNamespaces:
    """(fingerprint, tenant) -> the namespaces of that tenant that stored it, most recent last;
    bounded in entries (``capacity``), in namespaces per entry (``per_prompt``) and in distinct
    namespaces (``max_namespaces``: a new one beyond it is not noted, and counted in
    ``refused``)."""

    def __init__(self, capacity: int = 65536, per_prompt: int = 4, max_namespaces: int = 4096) -> None:
        self._seen: OrderedDict[tuple[bytes, Tenant], list[Namespace]] = OrderedDict()
        self._tenants: dict[bytes, list[Tenant]] = {}  # fingerprint -> tenants with an entry
        self._capacity = capacity
        self._per_prompt = per_prompt
        self._max_namespaces = max_namespaces
        self._lists: dict[Namespace, int] = {}  # namespace -> how many entries list it
        self.refused = 0  # notes of a new namespace refused: max_namespaces were remembered

    def __len__(self) -> int:
        return len(self._seen)

    def note(self, fingerprint: bytes, namespace: Namespace) -> bool:
        """Remember that ``namespace`` stored this first chunk (False: refused, over the bound)."""
        if namespace not in self._lists and len(self._lists) >= self._max_namespaces:
            self.refused += 1
            return False
        tenant = tenant_of(namespace)
        spaces = self._seen.pop((fingerprint, tenant), None)
        if spaces is None:
            spaces = []
            self._tenants.setdefault(fingerprint, []).append(tenant)
        if namespace in spaces:
            spaces.remove(namespace)
        else:
            self._count(namespace, 1)
        spaces.append(namespace)
        for dropped in spaces[: -self._per_prompt]:
            self._count(dropped, -1)
        self._seen[(fingerprint, tenant)] = spaces[-self._per_prompt :]
        while len(self._seen) > self._capacity:
            (old, old_tenant), dropped_spaces = self._seen.popitem(last=False)
            for dropped in dropped_spaces:
                self._count(dropped, -1)
            tenants = self._tenants[old]
            tenants.remove(old_tenant)
            if not tenants:
                del self._tenants[old]
        return True

    def others_than(self, namespace: Namespace) -> bool:
        """Whether a namespace other than ``namespace`` is remembered at all; when none is (one
        namespace stores everything), a lookup need not fingerprint its prompt."""
        return len(self._lists) > (namespace in self._lists)

    def _count(self, namespace: Namespace, delta: int) -> None:
        n = self._lists.get(namespace, 0) + delta
        if n:
            self._lists[namespace] = n
        else:
            del self._lists[namespace]

    def other(self, fingerprint: bytes, namespace: Namespace) -> Namespace | None:
        """The most recent other namespace of the same tenant that stored these tokens, else the
        most recent namespace of another tenant, else None."""
        tenant = tenant_of(namespace)
        for seen in reversed(self._seen.get((fingerprint, tenant), ())):
            if seen != namespace:
                return seen
        for other in reversed(self._tenants.get(fingerprint, ())):
            if other != tenant:
                return self._seen[(fingerprint, other)][-1]
        return None
