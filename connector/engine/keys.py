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
        h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=b"kvlens-ns-v1")
        for part in (
            self.model,
            self.dtype,
            self.kv_layout,
            str(self.world_size),
            self.lora or "",
            self.cache_salt or "",
            *(f"{k}={v}" for k, v in self.tags),
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
    parent: bytes, tokens: Sequence[int], start: int, chunk_size: int, block_size: int
) -> list[ChunkKey]:
    """Keys for the whole-block prefixes of the chunk at ``start``, longest first.

    A chunk that is not (yet) complete can still be shared block by block: a later prompt
    that extends this one finds the blocks it has in common instead of recomputing up to a
    whole chunk.
    """
    end = min(len(tokens), start + chunk_size)
    keys = []
    for length in range((end - start) // block_size * block_size, 0, -block_size):
        if length < chunk_size:
            keys.append(ChunkKey(chain(parent, tokens[start : start + length]), start, length))
    return keys


class PrefixHasher:
    """Incremental chunk keys for one request, so growing token lists hash each chunk once."""

    __slots__ = ("_namespace", "_chunk_size", "_full", "_hashed")

    def __init__(self, namespace: Namespace, chunk_size: int) -> None:
        self._namespace = namespace
        self._chunk_size = chunk_size
        self._full: list[ChunkKey] = []
        self._hashed: list[int] = []  # the tokens behind self._full

    @property
    def namespace(self) -> Namespace:
        return self._namespace

    def parent_of(self, key: ChunkKey | None) -> bytes:
        """The chain value a chunk following ``key`` (or the first chunk) hashes from."""
        return key.digest if key is not None else self._namespace.seed()

    def keys(self, tokens: Sequence[int], include_partial: bool) -> list[ChunkKey]:
        size = self._chunk_size
        full_end = len(tokens) - len(tokens) % size
        if self._hashed != list(tokens[: len(self._hashed)]):
            # Tokens were rolled back or replaced: start over rather than trust old keys.
            self._full, self._hashed = [], []
        parent = self._full[-1].digest if self._full else self._namespace.seed()
        for start in range(len(self._full) * size, full_end, size):
            parent = chain(parent, tokens[start : start + size])
            self._full.append(ChunkKey(parent, start, size))
        self._hashed = list(tokens[:full_end]) if full_end > len(self._hashed) else self._hashed
        keys = list(self._full)
        if include_partial and full_end < len(tokens):
            keys.append(ChunkKey(chain(parent, tokens[full_end:]), full_end, len(tokens) - full_end))
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
