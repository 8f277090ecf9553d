"""bench/ttft_peers.py keeps working end to end: real vLLM servers (tiny model, --quick), the
table, the JSON file. Never a timing assertion: on a shared 2-core machine only the shape of the
result is stable. A missing LMCache virtualenv must show as "unavailable", not as a crash."""

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


def test_quick_ttft_peers_writes_ratios_and_reports_lmcache_unavailable(tmp_path):
    cmd = [sys.executable, str(REPO / "bench" / "ttft_peers.py"), "--quick"]
    cmd += ["--modes", "none,kvlens,lmcache", "--kvlens-tiers", "cpu"]
    cmd += ["--lmcache-setup", "no", "--lmcache-venv", str(tmp_path / "no-venv-lmcache")]
    cmd += ["--out", str(tmp_path)]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]

    assert "unavailable: LMCache's virtualenv is not usable" in run.stdout
    assert "target KVLens hit <= 1.01 x floor, kvlens-cpu:" in run.stdout
    data = json.loads((tmp_path / "ttft_peers.json").read_text())
    assert set(data) >= {"meta", "settings", "modes", "summary", "ratios", "targets", "unavailable", "raw"}
    assert data["meta"]["modes"] == ["none", "kvlens-cpu", "lmcache"]
    assert set(data["unavailable"]) == {"lmcache"}
    summary = data["summary"]["all"]
    assert set(summary) == {"none", "kvlens-cpu"}
    targets = {(t["figure"], t["mode"]) for t in data["targets"]}
    assert targets == {("pair_ratio", "kvlens-cpu"), ("store_over_skip", "kvlens-cpu")}

    kv = summary["kvlens-cpu"]
    for key in ("cold_s", "floor_s", "hit_s", "pair_ratio", "hit_cached_tokens", "store_over_skip"):
        assert key in kv, key
    assert data["modes"]["kvlens-cpu"]["connector"] == "kvlens"
    assert kv["pair_ratio"]["n"] >= 1
    # The connector served the prefix that vLLM's flushed cache no longer had (a count, not a time).
    assert kv["hit_cached_tokens"]["median"] > 0
    assert kv["hit_served_all"]["all"] is True
    assert kv["skip_save_honoured"] == {"all": True, "n": 2}
    assert data["modes"]["none"]["connector"] is None
    assert "pair_ratio" not in summary["none"]  # without a connector the "hit" is a recompute
