"""What the benchmark smoke tests share about ``--server-pool``: which modes a run reused."""

from __future__ import annotations

NOTE = "servers reused from "  # bench/lib/served.py: "... FILE: MODES (they keep ...)", one per batch


def reused_modes(data: dict) -> set[str]:
    """The modes whose servers the run took from the pool (a note per batch of servers: memory
    may have split them)."""
    lists = [
        n.rsplit(" (they keep", 1)[0].rsplit(": ", 1)[1] for n in data["meta"]["notes"] if n.startswith(NOTE)
    ]
    return {name for names in lists for name in names.split(", ")}


def assert_reused_when_waiting(data: dict, waiting: int) -> None:
    """The run took both its servers (none, kvlens-cpu) from the pool exactly when both waited
    there before it (``waiting``), and no other."""
    modes = reused_modes(data)
    reused = modes == {"none", "kvlens-cpu"}
    assert reused == (waiting == 2) and modes <= {"none", "kvlens-cpu"}, (waiting, data["meta"]["notes"])
