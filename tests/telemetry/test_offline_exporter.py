"""The offline ``vllm.LLM`` publishes no connector stats; KVLENS_METRICS_PORT serves them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .serve import REPO, base_env, free_port

pytestmark = pytest.mark.integration


def test_offline_engine_serves_kvlens_metrics_on_localhost(tiny_model):
    port = free_port()
    env = base_env(KVLENS_METRICS_PORT=str(port), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("offline_metrics.py")), tiny_model],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    lines = [line for line in stdout.splitlines() if line.startswith('{"kv_transfer_params"')]
    assert proc.returncode == 0 and lines, stderr[-4000:]
    result = json.loads(lines[-1])
    assert result["kv_transfer_params"]["kvlens"]["loaded_tokens"] == {"cpu": 512}
    samples = {
        (s.name, s.labels.get("tier")): s.value
        for family in text_string_to_metric_families(result["metrics"])
        for s in family.samples
    }
    assert samples[("vllm:kvlens_lookup_requests_total", None)] == 2
    assert samples[("vllm:kvlens_load_tokens_total", "cpu")] == 512  # scheduler side
    assert samples[("vllm:kvlens_store_tokens_total", "cpu")] == 512  # worker side, relayed
    assert samples[("vllm:kvlens_request_trackers", None)] == 0
