"""Where the benchmarks keep what they build and write."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN_DIR = REPO / ".run" / "bench"


def peers_tmp() -> Path:
    """Where peer systems (LMCache) keep their virtualenvs, as the peer recipes define it."""
    return Path(os.environ.get("PEERS_TMP", "/tmp/peers"))
