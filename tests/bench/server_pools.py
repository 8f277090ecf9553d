"""What the benchmark smoke tests share about ``--server-pool``: the modes a run reused."""

from __future__ import annotations

NOTE = "servers reused from "  # bench/lib/served.py: "... FILE: MODES (they keep ...)", one per batch


def reused_modes(data: dict) -> set[str]:
    """The modes whose servers the run took from the pool (a note per batch of servers: memory
    may have split them)."""
    lists = [
        n.rsplit(" (they keep", 1)[0].rsplit(": ", 1)[1] for n in data["meta"]["notes"] if n.startswith(NOTE)
    ]
    return {name for names in lists for name in names.split(", ")}
