"""Namespace records: what a shared store says about the namespaces whose chunks it holds.

A chunk's name is a chained hash; the namespace it was keyed under (model, dtype, KV layout,
parallel size, LoRA, cache salt, tags) cannot be read back from it. So every chunk record
names its namespace's key fingerprint (``tiers/codec.py``), and an engine that stores under a
namespace writes one small record per namespace next to the chunks, saying what it is. A
record never holds a cache salt or a tag value: only whether the namespace is salted and its
tag names. Whoever knows a salt or a tag's values can still pick its namespace out: the record
holds every other part of the key, so ``Selector`` recomputes the fingerprint and compares.
Pure logic.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .facts import ModelIdentity
from .keys import Namespace, key_fingerprint

RECORD_VERSION = 1
FINGERPRINT = re.compile(r"^[0-9a-f]{12}$")
MAX_RECORD_BYTES = 64 * 1024  # a record is a few hundred bytes; anything far larger is not one


@dataclass(frozen=True, slots=True)
class NamespaceRecord:
    """One namespace, described without its secrets."""

    fingerprint: str  # key_fingerprint of the namespace: what its chunk records name
    model: str  # the model's identity as keyed (ModelIdentity.key(), or what the engine used)
    dtype: str
    kv_layout: str
    world_size: int
    lora: str | None  # the adapter's identity (content digest), None without LoRA
    salted: bool  # the requests carried a cache salt (never the salt itself)
    tag_names: tuple[str, ...]  # names of its lmcache.tag.* parameters (never their values)
    chunk_size: int  # tokens per chunk of the engine that wrote it (0: unknown)

    @classmethod
    def of(cls, namespace: Namespace, chunk_size: int = 0) -> NamespaceRecord:
        return cls(
            key_fingerprint(namespace),
            namespace.model,
            namespace.dtype,
            namespace.kv_layout,
            namespace.world_size,
            namespace.lora,
            namespace.cache_salt is not None,
            tuple(name for name, _ in namespace.tags),
            chunk_size,
        )

    @property
    def identity(self) -> ModelIdentity | None:
        """The parts of ``model`` when it is a ModelIdentity key (weights may hold '|')."""
        parts = self.model.rsplit("|", 4)
        return ModelIdentity(*parts) if len(parts) == 5 else None

    @property
    def weights(self) -> str:
        identity = self.identity
        return identity.weights if identity is not None else self.model

    def keyed_with(self, salt: str | None, tags: Mapping[str, str]) -> Namespace:
        """The namespace this record describes if its salt and tag values were these."""
        return Namespace(
            self.model,
            self.dtype,
            self.kv_layout,
            self.world_size,
            self.lora,
            salt,
            tuple(sorted(tags.items())),
        )

    def to_json(self) -> bytes:
        body = {
            "kvlens_namespace": RECORD_VERSION,
            "fingerprint": self.fingerprint,
            "model": self.model,
            "dtype": self.dtype,
            "kv_layout": self.kv_layout,
            "world_size": self.world_size,
            "lora": self.lora,
            "salted": self.salted,
            "tag_names": list(self.tag_names),
            "chunk_size": self.chunk_size,
        }
        return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> NamespaceRecord:
        """Raises ValueError for anything that is not a namespace record this version reads."""
        if len(raw) > MAX_RECORD_BYTES:
            raise ValueError("namespace record too large")
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise ValueError("namespace record is not JSON") from e
        if not isinstance(body, dict) or body.get("kvlens_namespace") != RECORD_VERSION:
            raise ValueError("not a KVLens namespace record (or of another version)")
        record = cls(
            _field(body, "fingerprint", str),
            _field(body, "model", str),
            _field(body, "dtype", str),
            _field(body, "kv_layout", str),
            _field(body, "world_size", int),
            _field(body, "lora", (str, type(None))),
            _field(body, "salted", bool),
            tuple(_field(body, "tag_names", list)),
            _field(body, "chunk_size", int),
        )
        if not FINGERPRINT.match(record.fingerprint) or not all(isinstance(t, str) for t in record.tag_names):
            raise ValueError("namespace record has a malformed fingerprint or tag names")
        if not record.salted and not record.tag_names:  # nothing secret: the record must add up
            if key_fingerprint(record.keyed_with(None, {})) != record.fingerprint:
                raise ValueError("namespace record does not match its fingerprint")
        return record


def _field(body: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"namespace record field {key!r} is missing or of the wrong type")
    return value


@dataclass(frozen=True, slots=True)
class Selector:
    """Which namespaces a clear takes: every criterion given must hold; none given means all.

    ``fingerprints`` match exactly or by a prefix of at least 6 digits. ``model`` matches the
    weights identity (``ckpt:<digest>``, ``named:<name>``, ``path:<path>``), the same without
    its scheme, a prefix of at least 6 characters of the checkpoint digest, or the whole model
    key. ``salt`` and ``tags`` pick the one namespace keyed with exactly that salt (or none) and
    exactly those tags: their fingerprint is recomputed from each record and compared.
    """

    fingerprints: frozenset[str] = frozenset()
    model: str | None = None
    salt: str | None = None
    tags: tuple[tuple[str, str], ...] = ()

    @property
    def everything(self) -> bool:
        return not self.fingerprints and self.model is None and self.salt is None and not self.tags

    def matches(self, record: NamespaceRecord) -> bool:
        fp = record.fingerprint
        if self.fingerprints and not any(_fingerprint_matches(f, fp) for f in self.fingerprints):
            return False
        if self.model is not None and not _model_matches(self.model, record):
            return False
        if self.salt is not None or self.tags:
            if record.salted != (self.salt is not None):
                return False
            if sorted(record.tag_names) != sorted(name for name, _ in self.tags):
                return False
            keyed = record.keyed_with(self.salt, dict(self.tags))
            return key_fingerprint(keyed) == record.fingerprint
        return True

    def matches_bare(self, fingerprint: str) -> bool:
        """Whether a namespace known only by its fingerprint (no record found) is taken: only
        when the selector names fingerprints and nothing else."""
        if self.model is not None or self.salt is not None or self.tags or not self.fingerprints:
            return False
        return any(_fingerprint_matches(f, fingerprint) for f in self.fingerprints)

    def takes(self, fingerprint: str, selected: set[str]) -> bool:
        """Whether a chunk stored under ``fingerprint`` is taken, ``selected`` being the
        fingerprints of the records the selector matched ("" is a chunk of unknown namespace)."""
        if self.everything:
            return True
        return bool(fingerprint) and (fingerprint in selected or self.matches_bare(fingerprint))

    def describe(self) -> str:
        """The selection in words, without the salt or tag values."""
        if self.everything:
            return "everything"
        parts = []
        if self.fingerprints:
            parts.append("namespace " + ",".join(sorted(self.fingerprints)))
        if self.model is not None:
            parts.append(f"model {self.model}")
        if self.salt is not None:
            parts.append("the given cache salt")
        if self.tags:
            parts.append("tags " + ",".join(sorted(name for name, _ in self.tags)))
        return " and ".join(parts)

    def to_json(self) -> dict[str, Any]:
        """For the admin endpoint's request body (sent to 127.0.0.1 by default)."""
        return {
            "namespaces": sorted(self.fingerprints),
            "model": self.model,
            "salt": self.salt,
            "tags": dict(self.tags),
        }

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Selector:
        """Raises ValueError naming the field that is wrong."""
        known = {"namespaces", "model", "salt", "tags", "all"}
        unknown = sorted(set(body) - known)
        if unknown:
            raise ValueError(f"unknown field(s): {', '.join(unknown)}")
        fingerprints = body.get("namespaces") or []
        if not isinstance(fingerprints, list) or not all(
            isinstance(f, str) and re.fullmatch(r"[0-9a-f]{6,12}", f) for f in fingerprints
        ):
            raise ValueError("'namespaces' must be a list of key fingerprints (6 to 12 hex digits)")
        model, salt, tags = body.get("model"), body.get("salt"), body.get("tags") or {}
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError("'model' must be a non-empty string")
        if salt is not None and not isinstance(salt, str):
            raise ValueError("'salt' must be a string")
        if not isinstance(tags, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in tags.items()
        ):
            raise ValueError("'tags' must map tag names to string values")
        selector = cls(frozenset(fingerprints), model, salt, tuple(sorted(tags.items())))
        if selector.everything and body.get("all") is not True:
            raise ValueError("say what to clear: namespaces, model, salt or tags, or all: true")
        return selector


def _fingerprint_matches(given: str, fingerprint: str) -> bool:
    return given == fingerprint or (len(given) >= 6 and fingerprint.startswith(given))


def _model_matches(given: str, record: NamespaceRecord) -> bool:
    weights = record.weights
    bare = weights.split(":", 1)[-1]
    return given in (weights, bare, record.model) or (
        weights.startswith("ckpt:") and len(given) >= 6 and bare.startswith(given)
    )


def select(records: Iterable[NamespaceRecord], selector: Selector) -> set[str]:
    """The fingerprints of the records the selector takes."""
    return {r.fingerprint for r in records if selector.matches(r)}
