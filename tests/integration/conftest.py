"""Real vLLM (CPU) end-to-end fixtures: a tiny local model, a runner, and a no-KVLens baseline."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from . import engine_forks, workloads

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("run_engine.py")


def disk_kv(directory: str, **extra) -> dict:
    """KVLens extra config for a disk-only tier in ``directory`` (plus ``lmcache.*`` overrides)."""
    kv = {
        "lmcache.chunk_size": 256,
        "lmcache.local_cpu": False,
        "lmcache.local_disk": directory,
        "lmcache.max_local_disk_size": 0.5,
    }
    kv.update({f"lmcache.{k}": v for k, v in extra.items()})
    return kv


def run_engine(
    spec: dict,
    tmp_path: Path,
    timeout: float = 420,
    env: dict | None = None,
    runner: Path = RUNNER,
    result: str = "rounds",
) -> dict:
    """Run one engine in a fresh process (forked from one that imported vLLM: ``engine_forks``);
    returns {"rounds": [...], "state": {...}, "log": its output}. Another ``runner`` script takes
    the spec file too and prints its result as the last JSON line whose first key is ``result``."""
    spec_file = tmp_path / f"spec-{os.getpid()}-{id(spec)}.json"
    spec_file.write_text(json.dumps(spec))
    env = {
        **os.environ,
        **(env or {}),
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    }
    if engine_forks.enabled():
        returncode, log = engine_forks.run(runner, spec_file, env, timeout)
    else:
        proc = subprocess.run(
            [sys.executable, str(runner), str(spec_file)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        returncode, log = proc.returncode, proc.stdout + proc.stderr
    lines = [ln for ln in log.splitlines() if ln.startswith(f'{{"{result}"')]
    if returncode != 0 or not lines:
        raise AssertionError(f"engine run failed (rc={returncode}):\n{log[-6000:]}")
    result = json.loads(lines[-1])
    result["log"] = log
    return result


@pytest.fixture(scope="session")
def baseline(tiny_model, tmp_path_factory) -> dict:
    """Greedy outputs of every batch in ``workloads.batches()`` from vLLM without KVLens.

    Each batch is sent as it is in the scenarios (same prompts, same order), so a KVLens run
    is compared with vLLM computing exactly the same batch cold.
    """
    batches = workloads.batches()
    rounds = [{"prompts": list(ps), "max_tokens": mt} for ps, mt in batches]

    def run() -> list:
        spec = {"model": tiny_model, "kv": None, "rounds": rounds}
        return run_engine(spec, tmp_path_factory.mktemp("base"))["rounds"]

    return {
        _batch_key(ps, mt): [o["token_ids"] for o in outs]
        for (ps, mt), outs in zip(batches, once_per_test_run(tmp_path_factory, "baseline", run), strict=True)
    }


def once_per_test_run(tmp_path_factory, name: str, compute):
    """``compute()`` (JSON-able), computed once for all pytest-xdist workers of this test run
    (the first asks, the others wait and read what it saved); plainly outside xdist."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return compute()
    shared = tmp_path_factory.getbasetemp().parent  # the run's folder, above each worker's own
    saved = shared / f"{name}.json"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if compute() raises
        if not saved.exists():
            scratch = shared / f"{name}.json.{os.getpid()}"
            scratch.write_text(json.dumps(compute()))
            scratch.replace(saved)
        return json.loads(saved.read_text())


def _batch_key(prompts, max_tokens) -> tuple:
    return tuple(tuple(p) for p in prompts), max_tokens


def expected(baseline, prompts, max_tokens=workloads.MAX_TOKENS) -> list[list[int]]:
    """vLLM's own output for this exact batch (it must be listed in ``workloads.batches()``)."""
    return baseline[_batch_key(prompts, max_tokens)]


def outputs(round_result) -> list[list[int]]:
    return [o["token_ids"] for o in round_result]


def lmcache_tokens(round_result) -> list[int]:
    return [(o["kv_transfer_params"] or {}).get("num_lmcache_cached_tokens") for o in round_result]


def cached_tokens(round_result) -> list[int]:
    return [o["num_cached_tokens"] for o in round_result]
