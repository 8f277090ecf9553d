"""bench/remote_tier_vs_bare.py keeps working (its --quick mode runs in seconds)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quick_side_by_side_prints_ratios_for_loads_and_stores_of_both_sizes(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "remote_tier_vs_bare.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "x bare" in run.stdout
    results = json.loads(out.read_text())["results"]
    assert [r["chunk_mib"] for r in results] == [4, 1]
    for result in results:
        assert set(result["ratio_to_bare"]) == {
            "tier get_many",
            "background get_many",
            "background get_many, readers not lowered",
            "redis-py GET",
            "tier put_many",
            "background put",
        }
        assert all(rate > 0 for rate in result["gb_per_s"].values())


def test_quick_references_run_the_alternatives_beside_the_reference(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "remote_tier_vs_bare.py"),
            "--quick",
            "--references",
            "--sizes",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert len(report["load_average"]["before"]) == 3
    (result,) = report["results"]
    for kind in ("GET", "SET"):
        for alternative in (
            "previous reference",
            "previous, timeout socket",
            "blocking socket",
            "blocking, WAITALL, one sendmsg",
        ):
            assert f"bare {kind}, {alternative}" in result["ratio_to_bare"]
