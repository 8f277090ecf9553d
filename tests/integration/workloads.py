"""Deterministic token-id prompts and the scenarios the end-to-end tests run.

Every batch a scenario sends is listed here, so that one baseline engine (vLLM without KVLens,
same dtype and settings) computes the reference output of each batch exactly as it was sent:
greedy outputs of a random tiny model depend on the batch's shape in their last bits, so
outputs are only compared between runs of the same batch.
"""

from __future__ import annotations

import random

MAX_TOKENS = 8
PREEMPT_MAX_TOKENS = 40  # crosses the block boundary at 640 tokens


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


SHARED = tokens(1, 512)  # two whole 256-token chunks
A = SHARED + tokens(2, 188)  # 700 tokens: two chunks and an unfull tail
B = SHARED + tokens(3, 88)  # same two chunks, another tail
C = A[:256] + tokens(4, 300)  # shares only the first chunk
SHORT = tokens(5, 200)  # shorter than one chunk
A_LONGER = A + tokens(6, 300)  # A extended: 1000 tokens
B_LONGER = B + tokens(7, 300)  # B extended: 900 tokens
PREEMPT = [SHARED + tokens(10 + i, 100) for i in range(4)]  # 612 tokens: 5 blocks, 6 once decoded
LONG = [tokens(100 + i, 3000) for i in range(16)]  # distinct long prompts: 11 chunks each
# Four prompts on one 512-token prefix, each with a whole chunk of its own (812 to 923 tokens).
SHARED_FOUR = [SHARED + tokens(20 + i, 300 + 37 * i) for i in range(4)]


def batches() -> list[tuple[tuple[list[int], ...], int]]:
    """Every (prompts, max_tokens) batch the default-engine scenarios send."""
    out: list[tuple[tuple[list[int], ...], int]] = []
    for batch in (
        [A],
        [A, B],
        [A, SHORT],
        [A, B, SHORT],
        [C],
        [A, C],
        [A_LONGER, B_LONGER],
        *([p] for p in LONG),
    ):
        out.append((tuple(batch), MAX_TOKENS))
    return out
