"""Deterministic token-id prompts shared by the end-to-end tests and their baseline."""

from __future__ import annotations

import random

MAX_TOKENS = 8
PREEMPT_MAX_TOKENS = 40  # crosses the block boundary at 640 tokens


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


SHARED = _tokens(1, 512)  # two whole 256-token chunks
A = SHARED + _tokens(2, 188)  # 700 tokens: two chunks and an unfull tail
B = SHARED + _tokens(3, 88)  # same two chunks, another tail
C = A[:256] + _tokens(4, 300)  # shares only the first chunk
SHORT = _tokens(5, 200)  # shorter than one chunk
PREEMPT = [SHARED + _tokens(10 + i, 100) for i in range(4)]  # 612 tokens: 5 blocks, 6 once decoded


def all_prompts() -> list[tuple[list[int], int]]:
    return [(p, MAX_TOKENS) for p in (A, B, C, SHORT)]
