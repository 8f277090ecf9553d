"""bench/pd_serve.py keeps working: its engine configurations, the vllm bench serve command it
runs and the figures it takes from the results; and (--quick, real vLLM) 1P1D and one instance
end to end. Never a timing assertion."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import pd_serve  # noqa: E402

# Two deployments one after another (three vLLM servers in all): up to 10 minutes each to start
# on this shared machine.
TIMEOUT_S = 2400


def test_the_engines_are_configured_as_lmcaches_1p1d_example_with_tcp():
    sender, receiver = pd_serve.pd_kv_transfer_configs(7500, 7300, 7400)
    assert sender["kv_role"] == "kv_producer" and receiver["kv_role"] == "kv_consumer"
    s, r = sender["kv_connector_extra_config"], receiver["kv_connector_extra_config"]
    assert s["lmcache.enable_pd"] is r["lmcache.enable_pd"] is True
    assert s["lmcache.transfer_channel"] == r["lmcache.transfer_channel"] == "tcp"
    assert (s["lmcache.pd_role"], s["lmcache.pd_proxy_host"], s["lmcache.pd_proxy_port"]) == (
        "sender",
        "127.0.0.1",
        7500,
    )
    assert (r["lmcache.pd_role"], r["lmcache.pd_peer_init_port"], r["lmcache.pd_peer_alloc_port"]) == (
        "receiver",
        [7300],
        [7400],
    )


def test_the_load_is_vllm_bench_serve_on_random_prompts():
    args = SimpleNamespace(
        input_len=2000,
        output_len=128,
        num_prompts=20,
        request_rate="0.3",
        max_concurrency=None,
        seed=7,
    )
    bench = SimpleNamespace(args=args, model=Path("/m"))
    argv = pd_serve.PDServe.bench_serve_args(bench, "http://h:1", "1p1d", 1, Path("/out/r.json"))
    flags = {flag: argv[i + 1] for i, flag in enumerate(argv[:-1]) if flag.startswith("--")}
    assert flags["--dataset-name"] == "random" and flags["--random-input-len"] == "2000"
    assert flags["--random-output-len"] == "128" and flags["--request-rate"] == "0.3"
    assert flags["--base-url"] == "http://h:1" and flags["--seed"] == "8"
    assert "itl" in flags["--percentile-metrics"] and "--max-concurrency" not in argv


def test_figures_come_from_the_result_file_and_the_proxys_counters():
    result = {"completed": 4, "failed": 0, "duration": 10.0, "request_throughput": 0.4}
    result |= {"output_throughput": 50.0, "p99_itl_ms": 30.5, "p50_ttft_ms": 100.0, "date": "x"}
    rec = pd_serve.result_record(result)
    assert rec["p99_itl_ms"] == 30.5 and rec["completed"] == 4 and "date" not in rec
    assert math.isnan(pd_serve.result_record({**result, "completed": 0})["p99_itl_ms"])
    before = {"wait_sum": 1.0, "wait_count": 2, "timeouts": 1, "loaded": 100, "computed": 10}
    after = {"wait_sum": 1.5, "wait_count": 7, "timeouts": 1, "loaded": 2100, "computed": 15}
    pd = pd_serve.pd_figures(before, after)
    assert pd["pd_transfer_wait_ms"] == pytest.approx(100.0) and pd["pd_wait_timeouts"] == 0
    assert pd["decoder_loaded_tokens"] == 2000 and pd["decoder_computed_tokens"] == 5


@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_quick_pd_serve_measures_1p1d_against_one_instance(tmp_path):
    """1P1D and the single instance it is compared with (three servers). ``rr2``, two more
    servers behind ``kvlens pd-proxy --no-pd``, is left to full runs: the suite's budget, and the
    proxy's round-robin is tested in tests/unit/test_pd_proxy.py."""
    cmd = [
        sys.executable,
        str(REPO / "bench" / "pd_serve.py"),
        "--quick",
        "--worker-in-core",
        "--modes",
        "single,1p1d",
    ]
    cmd += ["--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    data = json.loads((tmp_path / "pd_serve.json").read_text())
    assert data["unavailable"] == {}, data["unavailable"]
    summary = data["summary"]["all"]
    assert set(summary) == {"single", "1p1d"}
    for name, s in summary.items():
        assert s["failed"]["sum"] == 0 and s["completed"]["sum"] > 0, name
        for key in ("p50_ttft_ms", "p99_itl_ms", "output_throughput"):
            assert s[key]["n"] == 1, (name, key)
    assert set(data["ratios"]["all"]["1p1d"]) == {"single"}
    # PD did what it is for: the decoder loaded prompt tokens the prefiller sent
    assert summary["1p1d"]["decoder_loaded_tokens"]["median"] > 0
