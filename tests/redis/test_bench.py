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
    assert "exists_many(128) ms" in run.stdout
    summary = json.loads(out.read_text())["summary"]["all"]
    assert set(summary) == {"copy", "disk", "redis", "redis-batched"}
    assert all(s["put_gbps"]["median"] > 0 and s["get_gbps"]["median"] > 0 for s in summary.values())
    assert {"exists_many_16_ms", "exists_many_128_ms", "ping_ms"} <= set(summary["redis"])
