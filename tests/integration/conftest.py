"""Real vLLM (CPU) end-to-end fixtures: a tiny local model, a runner, and a no-KVLens baseline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from . import workloads

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("run_engine.py")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    built = REPO / ".run" / "tiny-model"
    if (built / "model.safetensors").exists() and (built / "config.json").exists():
        return str(built)
    out = tmp_path_factory.mktemp("tiny-model")
    subprocess.run([sys.executable, "-m", "connector.tiny_model", str(out)], cwd=REPO, check=True)
    return str(out)


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


def run_engine(spec: dict, tmp_path: Path, timeout: float = 420) -> dict:
    """Run one engine in a fresh process; returns {"rounds": [...], "state": {...}}."""
    spec_file = tmp_path / f"spec-{os.getpid()}-{id(spec)}.json"
    spec_file.write_text(json.dumps(spec))
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    }
    proc = subprocess.run(
        [sys.executable, str(RUNNER), str(spec_file)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"rounds"')]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"engine run failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}")
    result = json.loads(lines[-1])
    result["log"] = proc.stdout + proc.stderr
    return result


@pytest.fixture(scope="session")
def baseline(tiny_model, tmp_path_factory) -> dict[tuple[tuple[int, ...], int], list[int]]:
    """Greedy outputs of every workload prompt from vLLM without KVLens, computed cold."""
    groups: dict[int, list[list[int]]] = {}
    for prompt, max_tokens in workloads.all_prompts():
        if prompt not in groups.setdefault(max_tokens, []):
            groups[max_tokens].append(prompt)
    rounds = [{"prompts": ps, "max_tokens": mt} for mt, ps in sorted(groups.items())]
    result = run_engine({"model": tiny_model, "kv": None, "rounds": rounds}, tmp_path_factory.mktemp("base"))
    outputs = {}
    for rnd, outs in zip(rounds, result["rounds"], strict=True):
        for prompt, out in zip(rnd["prompts"], outs, strict=True):
            outputs[(tuple(prompt), rnd["max_tokens"])] = out["token_ids"]
    return outputs


def expected(baseline, prompts, max_tokens=workloads.MAX_TOKENS) -> list[list[int]]:
    return [baseline[(tuple(p), max_tokens)] for p in prompts]


def outputs(round_result) -> list[list[int]]:
    return [o["token_ids"] for o in round_result]


def lmcache_tokens(round_result) -> list[int]:
    return [(o["kv_transfer_params"] or {}).get("num_lmcache_cached_tokens") for o in round_result]


def cached_tokens(round_result) -> list[int]:
    return [o["num_cached_tokens"] for o in round_result]
