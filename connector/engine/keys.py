"""Chunk keys: chained, process-stable hashes of token prefixes.

A chunk's key depends on every token before it and on everything that makes KV
incompatible (model, dtype, KV layout, parallel layout, LoRA, cache salt, tags), so two
engines that share a store only ever exchange KV they could have computed themselves.
BLAKE2b is used rather than Python's ``hash()`` (salted per process) or a non-cryptographic
hash: a collision here would hand vLLM the wrong KV, so keys must be collision resistant.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DIGEST_SIZE = 16  # 128-bit chunk hashes
_LITTLE = sys.byteorder == "little"


def _token_bytes(tokens: Sequence[int]) -> bytes:
    arr = array("q", tokens)
    if not _LITTLE:  # pragma: no cover - keys must match across machines
        arr.byteswap()
    return arr.tobytes()


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything besides the tokens that a chunk's KV depends on."""

    model: str
    dtype: str
    kv_layout: str  # e.g. "bs128:L4:blk[2,128,128]:LBHNC", derived from the live KV cache
    world_size: int = 1
    lora: str | None = None
    cache_salt: str | None = None
    tags: tuple[tuple[str, str], ...] = ()

    def seed(self) -> bytes:
        # v1 wrote a tag as one part "name=value", so {"a=b": "c"} and {"a": "b=c"} shared
        # keys. v2 writes name and value as parts of their own; only tagged namespaces use
        # it, so untagged keys (and the chunks already stored under them) stay as they were.
        person = b"kvlens-ns-v2" if self.tags else b"kvlens-ns-v1"
        h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=person)
        for part in (
            self.model,
            self.dtype,
            self.kv_layout,
            str(self.world_size),
            self.lora or "",
            self.cache_salt or "",
            *(part for tag in self.tags for part in tag),
        ):
            data = part.encode()
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        return h.digest()

    def with_request(self, lora: str | None, cache_salt: str | None, tags: Mapping[str, str]) -> Namespace:
        return Namespace(
            self.model,
            self.dtype,
            self.kv_layout,
            self.world_size,
            lora,
            cache_salt,
            tuple(sorted(tags.items())),
        )


@dataclass(frozen=True, slots=True)
class ChunkKey:
    """One stored chunk: a chained hash plus the number of tokens it covers."""

    digest: bytes
    start: int  # first token of the chunk
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def hex(self) -> str:
        return self.digest.hex()


def chain(parent: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=b"kvlens-chunk-v1")
    h.update(parent)
    h.update(len(tokens).to_bytes(8, "little"))
    h.update(_token_bytes(tokens))
    return h.digest()


def chunk_keys(
    namespace: Namespace,
    tokens: Sequence[int],
    chunk_size: int,
    include_partial: bool,
) -> list[ChunkKey]:
    """Keys for consecutive chunks of ``tokens``; the last, shorter chunk only if asked."""
    keys: list[ChunkKey] = []
    parent = namespace.seed()
    n = len(tokens)
    full_end = n - n % chunk_size
    for start in range(0, full_end, chunk_size):
        parent = chain(parent, tokens[start : start + chunk_size])
        keys.append(ChunkKey(parent, start, chunk_size))
    if include_partial and full_end < n:
        keys.append(ChunkKey(chain(parent, tokens[full_end:]), full_end, n - full_end))
    return keys


def block_aligned_keys(
    parent: bytes, chunk_tokens: Sequence[int], start: int, chunk_size: int, block_size: int
) -> list[ChunkKey]:
    """Keys for the whole-block prefixes of one unfull chunk (``chunk_tokens``, starting at
    token ``start``), longest first.

    A chunk that is not (yet) complete can still be shared block by block: a later prompt
    that extends this one finds the blocks it has in common instead of recomputing up to a
    whole chunk.
    """
    n = min(len(chunk_tokens), chunk_size)
    keys = []
    for length in range(n // block_size * block_size, 0, -block_size):
        if length < chunk_size:
            keys.append(ChunkKey(chain(parent, chunk_tokens[:length]), start, length))
    return keys


class PrefixHasher:
    """Chunk keys of one request's tokens, hashed incrementally: each chunk once, ever.

    A request's token list only grows (vLLM appends generated tokens; a rollback after a
    failed load changes which tokens are computed, never their values), so the keys of the
    chunks hashed so far stay valid and each call hashes only chunks not seen before.
    """

    __slots__ = ("_namespace", "_seed", "_chunk_size", "_full")

    def __init__(self, namespace: Namespace, chunk_size: int) -> None:
        self._namespace = namespace
        self._seed = namespace.seed()
        self._chunk_size = chunk_size
        self._full: list[ChunkKey] = []

    @property
    def namespace(self) -> Namespace:
        return self._namespace

    @property
    def hashed_tokens(self) -> int:
        return len(self._full) * self._chunk_size

    def parent_of(self, key: ChunkKey | None) -> bytes:
        """The chain value a chunk following ``key`` (or the first chunk) hashes from."""
        return key.digest if key is not None else self._seed

    def extend(self, tokens: Sequence[int], upto: int) -> None:
        """Hash the whole chunks of ``tokens[:upto]`` not hashed yet (slicing only those)."""
        size = self._chunk_size
        end = min(upto, len(tokens))
        parent = self._full[-1].digest if self._full else self._seed
        for start in range(len(self._full) * size, end - size + 1, size):
            parent = chain(parent, tokens[start : start + size])
            self._full.append(ChunkKey(parent, start, size))

    def full_keys(self, start: int = 0, end: int | None = None) -> list[ChunkKey]:
        """Hashed whole-chunk keys ending after ``start`` and at or before ``end``."""
        size = self._chunk_size
        first = start // size
        last = len(self._full) if end is None else min(len(self._full), end // size)
        return self._full[first:last]

    def keys(self, tokens: Sequence[int], include_partial: bool, upto: int | None = None) -> list[ChunkKey]:
        """Keys of every whole chunk of ``tokens[:upto]`` and, if asked, of its unfull tail."""
        n = len(tokens) if upto is None else min(upto, len(tokens))
        self.extend(tokens, n)
        full_end = n - n % self._chunk_size
        keys = self.full_keys(0, full_end)
        if include_partial and full_end < n:
            parent = self.parent_of(keys[-1] if keys else None)
            keys.append(ChunkKey(chain(parent, tokens[full_end:n]), full_end, n - full_end))
        return keys


def parse_tags(params: Mapping[str, object] | None) -> dict[str, str]:
    """``lmcache.tag.<name>`` entries of a request's kv_transfer_params (strings only)."""
    if not params:
        return {}
    tags: dict[str, str] = {}
    for name, value in params.items():
        if isinstance(name, str) and name.startswith("lmcache.tag."):
            if not isinstance(value, (str, int)) or isinstance(value, bool):
                raise ValueError(f"{name} must be a string, got {type(value).__name__}")
            tags[name[len("lmcache.tag.") :]] = str(value)
    return tags


def storage_name(chunk: str, rank: int) -> str:
    """The name a tier stores one parallel rank's share of chunk ``chunk`` (a digest) under."""
    return f"{chunk}.r{rank}"
