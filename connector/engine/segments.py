"""A prompt cut into segments at the separator's tokens: the parts blending may reuse wherever they sit.

LMCache (``lmcache/v1/token_database.py``, ``SegmentTokenDatabase``) tokenizes
``blend_special_str`` once, drops the first id (``encode(s)[1:]``, assuming a BOS token; its own
TODO says it does not know when to) and cuts the prompt wherever those ids appear, matching with
sliding windows. Its example (``examples/blend_kv_v1/blend.py``) builds prompts by joining token
ids, never by tokenizing joined text, because a separator written into text may tokenize
differently where it touches its neighbours.

KVLens cuts the same way, with what LMCache leaves undefined defined:

- the separator is a token sequence the worker derives from the tokenizer without special
  tokens; it may pass several (how the separator tokenizes after different text), each found;
- matches are taken left to right and never overlap (where two would, the earlier wins; at one
  position the longest variant wins): LMCache's windows also report overlapping matches, and
  the cut between them then has a negative length;
- empty segments (a prompt that starts or ends with the separator, two separators in a row, a
  prompt of separators only) are not segments: nothing to reuse, nothing keyed;
- a separator inside a document cuts it in two segments; cutting depends on the tokens alone, so
  every prompt holding that document cuts it the same way and finds both halves again;
- a segment shorter than ``min_tokens`` (``blend_min_tokens``) is computed, never reused.

Segments and separators tile the prompt exactly, in order. Pure logic.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Segment:
    """Tokens ``[start, end)`` of the prompt, between separators (or the prompt's ends)."""

    index: int  # order among the prompt's segments
    start: int
    end: int
    reusable: bool  # False: shorter than blend_min_tokens, so computed

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Cut:
    """A prompt's segments and the separators between them, both in prompt order."""

    segments: tuple[Segment, ...]
    separators: tuple[tuple[int, int], ...]  # [start, end) of each separator found

    def reusable(self) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if s.reusable)


def separator_ids(encode: Callable[[str], Sequence[int]], text: str) -> tuple[int, ...]:
    """The separator's token ids from ``encode`` (a tokenizer called without special tokens:
    not LMCache's ``encode(text)[1:]``, which drops a real token where the tokenizer adds no BOS)."""
    ids = tuple(int(i) for i in encode(text))
    if not ids:
        raise ValueError(f"blend_special_str {text!r} encodes to no tokens: nothing to cut a prompt at")
    return ids


def find_separators(tokens: Sequence[int], separators: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """``[start, end)`` of every separator in ``tokens``: left to right, never overlapping, the
    longest variant where several start at one position."""
    variants = sorted({tuple(s) for s in separators if len(s)}, key=len, reverse=True)
    if not variants:
        raise ValueError("no separator tokens to cut at")
    ids = tokens if isinstance(tokens, list) else list(tokens)
    starts: dict[int, int] = {}  # position -> length of the longest variant found there
    for variant in variants:
        first, n, at = variant[0], len(variant), 0
        while True:
            try:
                at = ids.index(first, at)
            except ValueError:
                break
            if at not in starts and tuple(ids[at : at + n]) == variant:
                starts[at] = n
            at += 1
    found, free = [], 0
    for at in sorted(starts):
        if at >= free:
            found.append((at, at + starts[at]))
            free = at + starts[at]
    return found


def cut(tokens: Sequence[int], separators: Sequence[Sequence[int]], min_tokens: int) -> Cut:
    """The prompt ``tokens`` cut at ``separators`` (the separator's token sequences: one, or the
    variants of how it tokenizes in context)."""
    found = find_separators(tokens, separators)
    segments: list[Segment] = []
    at = 0
    for start, end in [*found, (len(tokens), len(tokens))]:
        if start > at:
            segments.append(Segment(len(segments), at, start, start - at >= max(min_tokens, 1)))
        at = end
    return Cut(tuple(segments), tuple(found))
