"""Which unfull chunks the index holds after each parent: a lookup that misses a whole chunk
then hashes only the whole-block prefixes of it that some stored chunk could match, instead of
every one (up to ``chunk_size / block_size - 1`` hashes, half of a cold lookup's time).

It is exact only while the scheduler admits every unfull chunk the index holds itself: the CPU
tier alone, with no disk or remote through which another engine's chunks arrive (whose parent
is unknown). The scheduler registers each unfull chunk it admits; the tier reports each chunk it
drops. Pure logic.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from .keys import chain


class TailDirectory:
    """Parent digest -> the lengths of the unfull chunks stored after it (a multiset)."""

    def __init__(self) -> None:
        self._lengths: dict[bytes, dict[int, int]] = {}  # parent -> length -> chunks of that length
        self._chunks: dict[str, tuple[bytes, int]] = {}  # chunk name -> (parent, length)

    def __len__(self) -> int:
        return len(self._chunks)

    def add(self, parent: bytes, length: int, name: str) -> None:
        if name in self._chunks:
            return
        self._chunks[name] = (parent, length)
        counts = self._lengths.setdefault(parent, {})
        counts[length] = counts.get(length, 0) + 1

    def discard(self, name: str) -> None:
        known = self._chunks.pop(name, None)
        if known is None:
            return
        parent, length = known
        counts = self._lengths[parent]
        counts[length] -= 1
        if not counts[length]:
            del counts[length]
            if not counts:
                del self._lengths[parent]

    def holds(self, parent: bytes, length: int) -> bool:
        """Whether an unfull chunk of ``length`` tokens is stored after ``parent``."""
        return length in self._lengths.get(parent, ())

    def lengths(self, parent: bytes) -> list[int]:
        """The lengths of the unfull chunks stored after ``parent``, longest first."""
        counts = self._lengths.get(parent)
        return sorted(counts, reverse=True) if counts else []

    def prefixes(
        self, parent: bytes, chunk_tokens: Sequence[int], chunk_size: int, block_size: int
    ) -> Iterator[tuple[int, bytes]]:
        """``keys.block_prefixes`` of one chunk, only of the lengths stored after ``parent``."""
        n = min(len(chunk_tokens), chunk_size - 1) // block_size * block_size
        for length in self.lengths(parent):
            if length <= n and length % block_size == 0:
                yield length, chain(parent, chunk_tokens[:length])
