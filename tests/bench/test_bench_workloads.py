"""bench/prefix_repetition.py, bench/multi_round_chat.py and bench/long_doc_qa.py keep working end
to end: real vLLM servers (tiny model, --quick), vllm bench serve, the chat users or the document
questions, the tables, the JSON file.
Never a timing assertion: on a shared 2-core machine only the shape of the result is stable
(and token counts, which do not depend on timing). A missing LMCache virtualenv must show as
"unavailable", not as a crash.

The three --quick workloads need servers of one shape: the first script starts them and leaves
them in a pool (--server-pool), the next two reuse them (and say so), and the module stops them.
A test run alone starts its own."""

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
# ~2-4 minutes here: two tiny-model servers, two repetitions each. On this shared machine a
# tiny-model server once took 7 minutes to start (load average near 190 from other jobs): the
# servers get 10 minutes to start, the whole run 15.
STARTUP_TIMEOUT_S = 600
TIMEOUT_S = 900
MODES = ["none", "kvlens-cpu", "lmcache"]
FIGURES = ("total_token_throughput", "output_throughput", "request_throughput", "p50_ttft_ms", "p99_ttft_ms")
RATIOS = {"total_token_throughput", "p50_ttft_ms"}  # to the baselines, per repetition


def run_quick(script: str, tmp_path: Path, pool) -> tuple[subprocess.CompletedProcess, dict]:
    """The script's --quick run; it reuses the servers an earlier test left in ``pool``, if any."""
    waiting = len(pool.waiting())
    cmd = [
        sys.executable,
        str(REPO / "bench" / script),
        "--quick",
        "--worker-in-core",
        "--modes",
        "none,kvlens,lmcache",
    ]
    cmd += ["--kvlens-tiers", "cpu", "--lmcache-setup", "no"]
    cmd += ["--lmcache-venv", str(tmp_path / "no-venv-lmcache"), "--out", str(tmp_path)]
    cmd += ["--startup-timeout", str(STARTUP_TIMEOUT_S), "--server-pool", str(pool.path)]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert "unavailable: LMCache's virtualenv is not usable" in run.stdout
    data = json.loads((tmp_path / f"{Path(script).stem}.json").read_text())
    assert (tmp_path / f"{Path(script).stem}.png").exists()
    assert_reused_when_waiting(data, waiting)  # both servers, when they wait there
    assert len(pool.waiting()) == 2  # and left there for the next test
    return run, data


def check_common_shape(data: dict, baselines: set[str]) -> dict:
    """The shape every workload's result has; its summary per mode."""
    assert set(data) >= {"meta", "settings", "workload", "ratios", "unavailable", "summary", "raw"}
    assert data["meta"]["modes"] == MODES
    assert set(data["unavailable"]) == {"lmcache"}
    summary = data["summary"]["all"]
    assert set(summary) == {"none", "kvlens-cpu"}
    assert set(data["baselines"]["kvlens-cpu"]) == baselines
    repeats = data["settings"]["repeats"]
    for name, s in summary.items():
        assert len(data["raw"]["all"][name]) == repeats, name
        for key in (*FIGURES, "tokens_computed", "tokens_vllm_hit", "tokens_connector"):
            assert s[key]["n"] == repeats, (name, key)
        assert s["failed"]["sum"] == 0, name
        requests = s["completed"]["sum"] + s["failed"]["sum"]
        assert requests == repeats * data["workload"]["requests_per_repetition"], name
    assert data["modes"]["kvlens-cpu"]["connector"] == "kvlens"
    assert data["modes"]["none"]["connector"] is None
    # The working set did not fit vLLM's KV memory: KVLens served prefixes that vLLM had evicted
    # (token counts from vLLM's /metrics, not times).
    assert data["workload"]["working_set_tokens"] > data["workload"]["kv_tokens"]
    assert summary["kvlens-cpu"]["tokens_connector"]["median"] > 0
    assert summary["none"]["tokens_connector"]["median"] == 0
    return summary


# First: its documents need the longest context (656 tokens), so its servers serve the others too.
def test_quick_long_doc_qa_serves_every_question_from_a_cache(tmp_path, server_pool):
    _, data = run_quick("long_doc_qa.py", tmp_path, server_pool)
    summary = check_common_shape(data, {"none"})
    assert set(data["ratios"]["all"]) == {"kvlens-cpu"}
    assert set(data["ratios"]["all"]["kvlens-cpu"]["none"]) >= RATIOS | {"p90_ttft_ms", "warmup_duration"}
    settings = data["settings"]
    queries = data["workload"]["queries_per_repetition"]
    assert queries == settings["documents"] * settings["questions"]
    for recs in data["raw"]["all"].values():
        assert all(r["errors"] == [] for r in recs)
        assert all(r["completed"] == data["workload"]["requests_per_repetition"] for r in recs)
    # vLLM keeps a third of the documents; with KVLens every question finds its document's
    # whole blocks in a cache (vLLM's own or KVLens's), as the responses report.
    whole_blocks = settings["doc_len"] // 128 * 128
    kv, none = summary["kvlens-cpu"], summary["none"]
    assert kv["query_cached_tokens"]["min"] == queries * whole_blocks
    assert none["query_cached_tokens"]["max"] < queries * whole_blocks


def test_quick_prefix_repetition_reports_ratios_to_none_and_lmcache_unavailable(tmp_path, server_pool):
    _, data = run_quick("prefix_repetition.py", tmp_path, server_pool)
    summary = check_common_shape(data, {"ceiling", "none"})
    assert data["workload"]["vllm_bench_serve"][:5] == ["vllm", "bench", "serve", "--backend", "openai"]
    assert "prefix_repetition" in data["workload"]["vllm_bench_serve"]
    # No ceiling in this run: ratios to none only, and the target cannot be judged.
    assert set(data["ratios"]["all"]) == {"kvlens-cpu"}
    assert set(data["ratios"]["all"]["kvlens-cpu"]) == {"none"}
    assert set(data["ratios"]["all"]["kvlens-cpu"]["none"]) >= RATIOS | {"p99_ttft_ms"}
    assert data["targets"] == []
    # vllm bench serve sent the same data set to both modes.
    none, kv = summary["none"], summary["kvlens-cpu"]
    assert none["total_input_tokens"]["median"] == kv["total_input_tokens"]["median"] > 0


def test_quick_multi_round_chat_reports_ratios_to_none_and_lmcache_unavailable(tmp_path, server_pool):
    _, data = run_quick("multi_round_chat.py", tmp_path, server_pool)
    check_common_shape(data, {"none"})
    assert set(data["ratios"]["all"]) == {"kvlens-cpu"}
    assert set(data["ratios"]["all"]["kvlens-cpu"]["none"]) >= RATIOS | {"p90_ttft_ms", "p99_ttft_ms"}
    for recs in data["raw"]["all"].values():
        assert all(r["errors"] == [] for r in recs)
