"""An in-process engine (notebooks, tests: VLLM_ENABLE_V1_MULTIPROCESSING=0) gives KVLens's
CPU tier back when it shuts down, and KVLens keeps no engine alive after it is gone."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).with_name("in_process_shutdown.py")
REPO = Path(__file__).resolve().parents[2]


def test_shutting_down_an_in_process_engine_frees_the_cpu_tier(tiny_model):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), tiny_model],
        cwd=REPO,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[-1])
    assert out["stored_mb"] > 100  # 16 prompts of 11 chunks of 1 MiB
    assert out["cpu_tier_mb_after"] == 0
    assert out["registered_connectors"] == 0 and not out["worker_connector_alive"]
    assert out["rss_drop_mb"] > 0.5 * out["stored_mb"], out
