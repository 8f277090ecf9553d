"""Names and payloads shared by the remote-tier tests."""

from __future__ import annotations

import random

MB = 1024 * 1024


def name(i: int) -> str:
    """A storage name shaped like KVLens's own (32 hex digits and a rank)."""
    return f"{i:032x}.r0"


def payload(nbytes: int, seed: int = 0) -> memoryview:
    """Deterministic bytes: the same (nbytes, seed) always gives the same payload."""
    return memoryview(bytearray(random.Random(seed).randbytes(nbytes)))
