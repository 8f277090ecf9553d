"""bench/prompt_scaling.py and bench/ttft_peers.py keep working end to end (--quick): real vLLM
servers on the tiny model, every figure in the JSON, and KVLens's hits served by KVLens. Never a
timing assertion: on a shared 2-core machine only the shape of the result is stable. A missing
LMCache virtualenv must show as "unavailable", not as a crash.

Both scripts need servers of one shape (1 GiB of KV memory): prompt_scaling.py, whose longest
prompt needs the longest context, starts them and leaves them in a pool (--server-pool),
ttft_peers.py reuses them (and says so), and the module stops them. A test run alone starts its
own."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from .server_pools import assert_reused_when_waiting

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 420  # ~2-3 minutes here: two tiny-model servers starting together
LENGTHS = ["500", "1500"]


def test_quick_prompt_scaling_reports_every_length_and_kvlens_serves_the_hits(tmp_path, server_pool):
    cmd = [
        sys.executable,
        str(REPO / "bench" / "prompt_scaling.py"),
        "--quick",
        "--worker-in-core",
        "--kvlens-tiers",
        "cpu",
    ]
    cmd += ["--lmcache-setup", "no", "--lmcache-venv", str(tmp_path / "no-venv-lmcache")]
    cmd += ["--out", str(tmp_path), "--server-pool", str(server_pool.path)]
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


def test_quick_ttft_peers_writes_ratios_and_reports_lmcache_unavailable(tmp_path, server_pool):
    cmd = [sys.executable, str(REPO / "bench" / "ttft_peers.py"), "--quick", "--worker-in-core"]
    cmd += ["--modes", "none,kvlens,lmcache", "--kvlens-tiers", "cpu"]
    cmd += ["--lmcache-setup", "no", "--lmcache-venv", str(tmp_path / "no-venv-lmcache")]
    cmd += ["--out", str(tmp_path), "--server-pool", str(server_pool.path)]
    waiting = len(server_pool.waiting())  # prompt_scaling's, unless this test runs alone
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]

    assert "unavailable: LMCache's virtualenv is not usable" in run.stdout
    assert "target KVLens hit <= 1.01 x floor, kvlens-cpu:" in run.stdout
    data = json.loads((tmp_path / "ttft_peers.json").read_text())
    assert_reused_when_waiting(data, waiting)
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
