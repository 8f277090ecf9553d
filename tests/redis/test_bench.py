"""bench/redis_tier.py keeps working (its --quick mode runs in a few seconds)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quick_benchmark_prints_a_table_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "redis_tier.py"),
            "--quick",
            "--chunk-mb",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "exists_many(128)" in run.stdout
    result = json.loads(out.read_text())
    assert set(result["throughput_gbps"]) >= {
        "bytes copy (in process)",
        "put, one per call",
        "get, one per call",
    }
    assert all(v > 0 for v in result["throughput_gbps"].values())
    assert set(result["latency_ms"]) == {"exists_many(16)", "exists_many(128)", "ping"}
