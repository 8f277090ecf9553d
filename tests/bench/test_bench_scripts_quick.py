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
    out = run("lookup.py", "--reps", "5", "--out", str(tmp_path / "lookup.json"))
    assert "lookup µs/1k tokens" in out
    lookup = json.loads((tmp_path / "lookup.json").read_text())
    assert len(lookup["cases"]) == 10 and lookup["modes"] == {"tree": {"label": "this tree"}}
    assert all(by["tree"]["lookup_us_per_1k_tokens"]["n"] >= 15 for by in lookup["summary"].values())
    run("planning.py", "--out", str(tmp_path / "planning.json"))
    planning = json.loads((tmp_path / "planning.json").read_text())["ratios"]["8"]
    assert planning["8192"]["1024"]["plan_us_per_decode_step"]["n"] == 20  # one ratio per decode step


def test_lookup_compares_a_revision_side_by_side(tmp_path):
    run("lookup.py", "--reps", "1", "--compare", "HEAD", "--out", str(tmp_path / "lookup.json"))
    ratios = json.loads((tmp_path / "lookup.json").read_text())["ratios"]
    assert all(set(by["tree"]) == {"HEAD"} for by in ratios.values())


@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_hit_profile_quick_times_a_real_kvlens_hit(tmp_path):
    out = run("hit_profile.py", "--out", str(tmp_path), timeout=600)
    assert "TTFT ms x floor" in out
    summary = json.loads((tmp_path / "hit_profile-layerwise-true.json").read_text())["summary"]["all"]
    hit, floor = summary["hit"], summary["floor"]
    assert hit["cached_tokens"]["median"] == floor["cached_tokens"]["median"] > 0  # the hit came from KVLens
    assert hit["model_forward_ms"]["median"] > 0
    assert hit["start_load_kv_ms"]["median"] > floor["start_load_kv_ms"]["median"]  # KVLens read the chunks


@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_telemetry_overhead_quick_accounts_for_kvlens_telemetry_and_switches_it(tmp_path):
    run("telemetry_overhead.py", "--out", str(tmp_path / "telemetry.json"), timeout=600)
    data = json.loads((tmp_path / "telemetry.json").read_text())
    assert data["ratios"]["A/B"]["on"]["off"]["pass_ms"]["n"] == 2
    on = data["summary"]["accounting"]["on"]
    assert on["step_loop_us_per_request"]["median"] > 0 and on["background_us_per_request"]["median"] > 0
    assert data["workload"]["step_loop_wall"], "no telemetry function was timed"

    run("telemetry_overhead.py", "--compare", "whatif", "--out", str(tmp_path / "whatif.json"), timeout=600)
    ab = json.loads((tmp_path / "whatif.json").read_text())["summary"]["A/B"]
    assert ab["on"]["whatif_references"]["min"] > 0  # the feature recorded in every "on" pass
    assert ab["off"]["whatif_references"]["max"] == 0  # and in no "off" pass
