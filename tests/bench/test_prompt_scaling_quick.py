"""bench/prompt_scaling.py keeps working end to end (--quick): real vLLM servers on the tiny
model, two prompt lengths, every figure in the JSON, and KVLens's hits served by KVLens at every
length. Never a timing assertion: on a shared 2-core machine only the shape of the result is
stable. A missing LMCache virtualenv must show as "unavailable", not as a crash."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 420  # ~2-3 minutes here: two tiny-model servers starting together
LENGTHS = ["500", "1500"]


def test_quick_prompt_scaling_reports_every_length_and_kvlens_serves_the_hits(tmp_path):
    cmd = [sys.executable, str(REPO / "bench" / "prompt_scaling.py"), "--quick", "--kvlens-tiers", "cpu"]
    cmd += ["--lmcache-setup", "no", "--lmcache-venv", str(tmp_path / "no-venv-lmcache")]
    cmd += ["--out", str(tmp_path)]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]

    assert "unavailable: LMCache's virtualenv is not usable" in run.stdout
    assert "target KVLens hit <= 1.01 x floor at every length, kvlens-cpu" in run.stdout
    data = json.loads((tmp_path / "prompt_scaling.json").read_text())
    assert set(data) >= {
        "meta",
        "settings",
        "workload",
        "cases",
        "summary",
        "ratios",
        "targets",
        "unavailable",
    }
    assert data["meta"]["modes"] == ["none", "kvlens-cpu", "lmcache"]
    assert data["workload"]["lengths"] == [500, 1500]
    assert data["cases"] == LENGTHS
    assert set(data["unavailable"]) == {"lmcache"}
    (target,) = data["targets"]
    assert (target["mode"], set(target["values"])) == ("kvlens-cpu", set(LENGTHS))

    for length in LENGTHS:
        assert set(data["summary"][length]) == {"none", "kvlens-cpu"}
        kv = data["summary"][length]["kvlens-cpu"]
        (raw,) = data["raw"][length]["kvlens-cpu"]
        assert len(raw["pair_ratio"]) == kv["pair_ratio"]["n"] == 1
        # The connector served the prefix that vLLM's flushed cache no longer had (a count, not a time).
        assert kv["hit_cached_tokens"]["median"] > 0
        assert kv["first_token_matches"]["all"] is True
        assert raw["kvlens_load_ms"], "KVLens reported no load time for its hit"
        none = data["summary"][length]["none"]
        assert none["hit_cached_tokens"]["median"] == 0  # without a connector the flush loses it all
        assert none["floor_cached_tokens"]["median"] > 0
    assert (tmp_path / "prompt_scaling.png").exists()
