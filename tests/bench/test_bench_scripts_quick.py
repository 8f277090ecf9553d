"""The smaller bench scripts keep working (--quick): they run to the end and print their
figures. Never a timing assertion."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run(script: str, *args: str, timeout: int = 300) -> str:
    cmd = [sys.executable, str(REPO / "bench" / script), "--quick", *args]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


def test_lookup_and_planning_quick(tmp_path):
    assert "per 1k" in run("lookup.py", "--out", str(tmp_path / "lookup.json")).lower()
    run("planning.py", "--out", str(tmp_path / "planning.json"))
    assert json.loads((tmp_path / "planning.json").read_text())


@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_hit_profile_quick_times_a_real_kvlens_hit(tmp_path):
    out = run("hit_profile.py", "--out", str(tmp_path), timeout=600)
    assert "hit / floor" in out
    summary = json.loads((tmp_path / "hit_profile-layerwise-true.json").read_text())["summary"]
    assert summary["hit_cached"] == summary["floor_cached"] > 0  # the hit came from KVLens
    assert summary["model forward_ms"] > 0
