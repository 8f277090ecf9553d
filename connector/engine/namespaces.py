"""Telling "never stored" from "stored under another namespace" (the "two instances never
share" case): a bounded memory of which namespaces stored a prompt's first chunk.

A chunk's key covers the namespace (model, dtype, KV layout, parallel size, LoRA, cache salt,
tags), so a prompt stored under one namespace is simply absent under another. To explain such
a miss, the scheduler notes, for every request that stores, a namespace-free fingerprint of
its first chunk's tokens (``keys.first_chunk_fingerprint``) and the namespace it stores under.
A lookup whose first chunk is missing asks whether another namespace stored those tokens, and
which parts of the namespace differ (names only: a cache salt or a tag value is never
reported). Pure logic.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import fields

from .keys import Namespace


def namespace_differences(mine: Namespace, other: Namespace) -> list[str]:
    """The names of the namespace parts that differ (model, dtype, kv_layout, lora, ...)."""
    return [f.name for f in fields(Namespace) if getattr(mine, f.name) != getattr(other, f.name)]


class FirstChunkNamespaces:
    """Fingerprint -> the namespaces that stored it, most recent last; bounded in entries."""

    def __init__(self, capacity: int = 65536, per_prompt: int = 4) -> None:
        self._seen: OrderedDict[bytes, list[Namespace]] = OrderedDict()
        self._capacity = capacity
        self._per_prompt = per_prompt
        self._lists: dict[Namespace, int] = {}  # namespace -> how many fingerprints list it

    def __len__(self) -> int:
        return len(self._seen)

    def note(self, fingerprint: bytes, namespace: Namespace) -> None:
        spaces = self._seen.pop(fingerprint, [])
        if namespace in spaces:
            spaces.remove(namespace)
        else:
            self._count(namespace, 1)
        spaces.append(namespace)
        for dropped in spaces[: -self._per_prompt]:
            self._count(dropped, -1)
        self._seen[fingerprint] = spaces[-self._per_prompt :]
        while len(self._seen) > self._capacity:
            for dropped in self._seen.popitem(last=False)[1]:
                self._count(dropped, -1)

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
        """The most recent other namespace that stored these tokens, if any."""
        for seen in reversed(self._seen.get(fingerprint, ())):
            if seen != namespace:
                return seen
        return None
