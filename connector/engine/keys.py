"""Chunk keys: chained, process-stable hashes of token prefixes.

A chunk's key depends on every token before it and on everything that makes KV
incompatible (model, dtype, KV layout, parallel layout, LoRA, cache salt, tags), so two
engines that share a store only ever exchange KV they could have computed themselves.
BLAKE2b is used rather than Python's ``hash()`` (salted per process) or a non-cryptographic
hash: a collision here would hand vLLM the wrong KV, so keys must be collision resistant.

A chunk's key (v2) is BLAKE2b over its parent's 16-byte digest followed by its token ids,
little-endian: 4 bytes each when every id of the chunk fits in 32 bits (every vocabulary
today), else 8 bytes each (signed, as in v1). The two widths hash under different ``person``
strings, so they are two unrelated functions: ``[1, 1]`` in 4 bytes and ``[1 + 2**32]`` in 8
are the same bytes but never the same key. The parent has a fixed length and the width is
fixed per key, so the bytes decode to one token list and no length is needed; that lets the
keys of a chunk's whole-block prefixes share one pass over its tokens
(``block_prefixes``). v1 hashed 8 bytes a token after a length: converting ids to 8-byte
integers was the largest cost of a lookup.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

DIGEST_SIZE = 16  # 128-bit chunk hashes
CHUNK_KEY_VERSION = b"kvlens-chunk-v2"
_LITTLE = sys.byteorder == "little"
_U32 = next(code for code in "IL" if array(code).itemsize == 4)
# Hash states to copy: building one with a person string costs more than hashing 1 KB.
_NARROW = hashlib.blake2b(digest_size=DIGEST_SIZE, person=CHUNK_KEY_VERSION)
_WIDE = hashlib.blake2b(digest_size=DIGEST_SIZE, person=CHUNK_KEY_VERSION + b"w")


def _narrow(tokens: Sequence[int]) -> array | None:
    """The ids as 4-byte little-endian integers; None when one does not fit (or is negative)."""
    try:
        arr = array(_U32, tokens)
    except OverflowError:
        return None
    if not _LITTLE:  # pragma: no cover - keys must match across machines
        arr.byteswap()
    return arr


def _wide(tokens: Sequence[int]) -> bytes:
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
        """The chain's first parent (memoized: every request's hasher asks)."""
        return _seed(self)

    def with_request(self, lora: str | None, cache_salt: str | None, tags: Mapping[str, str]) -> Namespace:
        if lora == self.lora and cache_salt == self.cache_salt and not tags and not self.tags:
            return self
        return Namespace(
            self.model,
            self.dtype,
            self.kv_layout,
            self.world_size,
            lora,
            cache_salt,
            tuple(sorted(tags.items())),
        )


@functools.lru_cache(maxsize=1024)
def _seed(namespace: Namespace) -> bytes:
    # v1 wrote a tag as one part "name=value", so {"a=b": "c"} and {"a": "b=c"} shared
    # keys. v2 writes name and value as parts of their own; only tagged namespaces use
    # it, so untagged seeds stayed as they were.
    person = b"kvlens-ns-v2" if namespace.tags else b"kvlens-ns-v1"
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=person)
    for part in (
        namespace.model,
        namespace.dtype,
        namespace.kv_layout,
        str(namespace.world_size),
        namespace.lora or "",
        namespace.cache_salt or "",
        *(part for tag in namespace.tags for part in tag),
    ):
        data = part.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


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
    """The key of the chunk ``tokens`` following the chunk (or namespace seed) ``parent``."""
    narrow = _narrow(tokens)
    h = _NARROW.copy() if narrow is not None else _WIDE.copy()
    h.update(parent)
    h.update(narrow if narrow is not None else _wide(tokens))
    return h.digest()


def chain_chunks(parent: bytes, tokens: Sequence[int], chunk_size: int) -> list[bytes]:
    """The chained keys of consecutive whole chunks of ``tokens`` (a multiple of ``chunk_size``),
    converting the ids in one go."""
    narrow = _narrow(tokens)
    digests = []
    if narrow is None:  # some chunk needs 8 bytes a token: each chunk picks its own width
        for start in range(0, len(tokens), chunk_size):
            parent = chain(parent, tokens[start : start + chunk_size])
            digests.append(parent)
        return digests
    view, step = memoryview(narrow).cast("B"), 4 * chunk_size
    for at in range(0, len(view), step):
        h = _NARROW.copy()
        h.update(parent)
        h.update(view[at : at + step])
        parent = h.digest()
        digests.append(parent)
    return digests


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


def block_prefixes(
    parent: bytes, chunk_tokens: Sequence[int], chunk_size: int, block_size: int
) -> Iterator[tuple[int, bytes]]:
    """``(length, digest)`` of each whole-block prefix of one unfull chunk, longest first, lazily.

    A chunk that is not (yet) complete can still be shared block by block: a later prompt
    that extends this one finds the blocks it has in common instead of recomputing up to a
    whole chunk. The longest prefix (the one a repeated prompt stored) costs one hash; the
    shorter ones share a second pass, one hash state copied at each block boundary, and only
    when asked for.
    """
    n = min(len(chunk_tokens), chunk_size - 1) // block_size * block_size
    narrow = _narrow(chunk_tokens[:n]) if n else None
    if narrow is None:  # a long prefix needs 8 bytes a token, shorter ones may not
        yield from ((length, chain(parent, chunk_tokens[:length])) for length in range(n, 0, -block_size))
        return
    h = _NARROW.copy()
    h.update(parent)
    longest = h.copy()
    longest.update(narrow)
    yield n, longest.digest()
    view, step = memoryview(narrow).cast("B"), 4 * block_size
    shorter = []
    for at in range(0, len(view) - step, step):
        h.update(view[at : at + step])
        shorter.append(((at + step) // 4, h.copy().digest()))
    yield from reversed(shorter)


def block_aligned_keys(
    parent: bytes, chunk_tokens: Sequence[int], start: int, chunk_size: int, block_size: int
) -> list[ChunkKey]:
    """``block_prefixes`` as keys of a chunk starting at token ``start``, longest first."""
    return [ChunkKey(d, start, n) for n, d in block_prefixes(parent, chunk_tokens, chunk_size, block_size)]


@functools.lru_cache(maxsize=1024)
def key_fingerprint(namespace: Namespace) -> str:
    """Twelve hex digits, equal for two engines when their chunk keys agree: the namespace and
    the key version (the info gauge's ``key_fingerprint``; v1 engines showed the seed's)."""
    return hashlib.blake2b(namespace.seed(), digest_size=6, person=CHUNK_KEY_VERSION).hexdigest()


_TOKENS_ONLY = b"kvlens-tokens-v2"  # the fingerprint's parent (16 bytes, like a digest)


def first_chunk_fingerprint(tokens: Sequence[int], chunk_size: int) -> bytes | None:
    """The namespace-free hash of the first whole chunk (namespaces.py explains misses with
    it); None for a shorter prompt. Never a key: it lives in the scheduler's memory only."""
    if len(tokens) < chunk_size:
        return None
    return chain(_TOKENS_ONLY, tokens[:chunk_size])


class PrefixHasher:
    """Chunk keys of one request's tokens, hashed incrementally: each chunk once, ever.

    A request's token list only grows (vLLM appends generated tokens; a rollback after a
    failed load changes which tokens are computed, never their values), so the keys of the
    chunks hashed so far stay valid and each call hashes only chunks not seen before.
    """

    __slots__ = ("_namespace", "_seed", "_chunk_size", "_full", "_fingerprint")

    def __init__(self, namespace: Namespace, chunk_size: int) -> None:
        self._namespace = namespace
        self._seed = namespace.seed()
        self._chunk_size = chunk_size
        self._full: list[ChunkKey] = []
        self._fingerprint: bytes | None = None

    @property
    def namespace(self) -> Namespace:
        return self._namespace

    @property
    def hashed_tokens(self) -> int:
        return len(self._full) * self._chunk_size

    def parent_of(self, key: ChunkKey | None) -> bytes:
        """The chain value a chunk following ``key`` (or the first chunk) hashes from."""
        return key.digest if key is not None else self._seed

    def parent_at(self, start: int) -> bytes:
        """The chain value the chunk starting at token ``start`` hashes from (hashed before it)."""
        return self._full[start // self._chunk_size - 1].digest if start >= self._chunk_size else self._seed

    def extend(self, tokens: Sequence[int], upto: int) -> None:
        """Hash the whole chunks of ``tokens[:upto]`` not hashed yet (slicing only those)."""
        size = self._chunk_size
        first = len(self._full) * size
        end = min(upto, len(tokens))
        end -= end % size
        if end <= first:
            return
        parent = self._full[-1].digest if self._full else self._seed
        digests = chain_chunks(parent, tokens[first:end], size)
        self._full += [ChunkKey(d, s, size) for d, s in zip(digests, range(first, end, size), strict=True)]

    def fingerprint(self, tokens: Sequence[int]) -> bytes | None:
        """``first_chunk_fingerprint`` of the request, hashed once (a lookup that misses and the
        request's first schedule both ask)."""
        if self._fingerprint is None:
            self._fingerprint = first_chunk_fingerprint(tokens, self._chunk_size)
        return self._fingerprint

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
        keys = self.full_keys(0, n - n % self._chunk_size)
        tail = self.tail_key(tokens, n) if include_partial else None
        if tail is not None:
            keys.append(tail)
        return keys

    def tail_key(self, tokens: Sequence[int], upto: int | None = None) -> ChunkKey | None:
        """The key of the unfull chunk that ends ``tokens[:upto]``; None if it ends a chunk."""
        size = self._chunk_size
        n = len(tokens) if upto is None else min(upto, len(tokens))
        full_end = n - n % size
        if full_end == n:
            return None
        self.extend(tokens, full_end)
        return ChunkKey(chain(self.parent_at(full_end), tokens[full_end:n]), full_end, n - full_end)


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
