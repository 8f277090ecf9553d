"""vLLM blocks whose KV may be wrong because a load into them failed.

After a failed load vLLM rolls the affected requests back and recomputes the failed blocks,
but until that recompute has run, a block can still be read: by a request of the same step,
or by a later request that got a prefix-cache hit on it in vLLM. KV computed over such a
block is wrong, so KVLens never stores a chunk whose prefix holds a suspect block.

Every block computed over a suspect block is wrong too: a request whose prefix holds a block
whose load failed computed its later blocks (in that step, and with asynchronous scheduling in
the steps planned before the failure was reported) from wrong KV, so those blocks become
suspect with it (``downstream``), and another request that gets vLLM prefix hits on them
stores nothing over them.

A block stops being suspect once a step writes it whole again (a compute that covers every
position of it, or a load into it); if that load fails, the worker's report makes it
suspect again. Within one step vLLM writes every token's KV before any attention reads it,
so chunks computed in the same step as the recompute are sound.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class SuspectBlocks:
    def __init__(self) -> None:
        self._blocks: set[int] = set()

    def __len__(self) -> int:
        return len(self._blocks)

    def __bool__(self) -> bool:
        return bool(self._blocks)

    def add(self, block_ids: Iterable[int]) -> None:
        self._blocks.update(block_ids)

    def written(self, block_ids: Iterable[int]) -> None:
        """These blocks are written whole in the step being planned."""
        if self._blocks:
            self._blocks.difference_update(block_ids)

    def spread(self, block_ids: Sequence[int], computed_blocks: int) -> None:
        """A request computed over its first ``computed_blocks`` blocks: if one is suspect,
        every later one holds KV computed over it."""
        if self._blocks and not self._blocks.isdisjoint(block_ids[:computed_blocks]):
            self._blocks.update(downstream(block_ids, self._blocks, computed_blocks))

    def first_in(self, block_ids: Sequence[int], end: int) -> int | None:
        """Index of the first suspect block among ``block_ids[:end]``, if any."""
        if not self._blocks:
            return None
        for i, b in enumerate(block_ids[:end]):
            if b in self._blocks:
                return i
        return None

    def clear(self) -> None:
        self._blocks.clear()


def downstream(block_ids: Sequence[int], bad: set[int], computed_blocks: int) -> Sequence[int]:
    """The blocks of one request from its first ``bad`` block to the end of what it has
    computed: all of them hold KV computed over the bad one (empty if it holds none)."""
    for i, b in enumerate(block_ids[:computed_blocks]):
        if b in bad:
            return block_ids[i:computed_blocks]
    return ()


def rewritten_blocks(
    block_ids: Sequence[int], start_token: int, end_token: int, block_size: int
) -> list[int]:
    """Blocks whose every valid position a computation of tokens [start_token, end_token) writes.

    ``end_token`` is where the request's computed tokens end, so a last block cut short by
    it holds no other valid positions; a first block that starts before ``start_token`` does.
    """
    first = -(-start_token // block_size)
    last = -(-end_token // block_size)
    return list(block_ids[first:last])
