"""A batch job with KVLens ends with exit status 0, its threads stopped."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..telemetry.serve import free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_an_offline_job_with_every_feature_on_exits_cleanly(tiny_model, tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "KVLENS_METRICS_PORT": str(free_port()),
        "KVLENS_TRACING": "1",  # spans exported over OTLP to a port nobody listens on
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{free_port()}/v1/traces",
        "KVLENS_EVENT_LOG": str(tmp_path / "events.jsonl"),
    }
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("offline_job.py")), tiny_model, str(tmp_path / "kv")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    log = proc.stdout + proc.stderr
    assert "JOB DONE" in proc.stdout, log[-6000:]
    assert "terminate called" not in log, log[-6000:]
    assert proc.returncode == 0, log[-6000:]
