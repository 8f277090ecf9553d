"""The benchmark models: deterministic random Llamas built locally, once, under ``.run/bench``,
and the real model (``--real``).

There is no model hub here; ``scripts/tiny_model.py`` writes a checkpoint vLLM loads like any
other. The same arguments give byte-identical files, so a model is rebuilt only when its
arguments or the builder change (a stamp file records both). The real model is
SmolLM2-135M-Instruct (30 layers, 3 KV heads of 64, vocabulary 49,152, 8k context), which
``scripts/setup.sh`` converts into ``$KVLENS_REAL_MODEL`` (default ``$KVLENS_RUN_DIR/smollm2-135m``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .paths import REPO, RUN_DIR

BUILD_TIMEOUT_S = 900.0
REAL_MODEL_WAIT_S = 120.0  # setup.sh may be re-creating the real model's directory (a rename)
REAL_HELP = (
    "the real model (SmolLM2-135M-Instruct in $KVLENS_REAL_MODEL, default $KVLENS_RUN_DIR/smollm2-135m) "
    "instead of the random bench model; results go to NAME-real.json"
)
STAMP = ".bench-stamp"
BYTES_PER_ELEMENT = 2  # bf16


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str  # directory name under .run/bench/models
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    max_pos: int
    vocab: int = 2000
    seed: int = 0

    def builder_args(self) -> list[str]:
        return [f"--{k.replace('_', '-')}={v}" for k, v in asdict(self).items() if k != "name"]


# --quick: the test suite's tiny model (3M parameters); a 1,000-token prefill takes ~0.3 s.
TINY = ModelSpec("tiny", layers=4, hidden=256, heads=4, kv_heads=2, intermediate=512, max_pos=8192)
# Full runs: the model of REFERENCE.md section 9 (hidden 1024, 8 layers, ~126M parameters,
# 16 KiB of KV per token: a 3,000-token prompt is 49 MB of KV).
BENCH = ModelSpec(
    "llama-h1024-l8", layers=8, hidden=1024, heads=16, kv_heads=8, intermediate=4096, max_pos=8192
)
# The same shape with room for 32k-token prompts (prompt_scaling.py): vLLM refuses a
# --max-model-len beyond the checkpoint's max_position_embeddings.
BENCH_32K = replace(BENCH, name="llama-h1024-l8-32k", max_pos=32768)


def _stamp(spec: ModelSpec) -> str:
    builder = (REPO / "scripts" / "tiny_model.py").read_bytes()
    return json.dumps({"spec": asdict(spec), "builder_sha256": hashlib.sha256(builder).hexdigest()[:16]})


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """One builder at a time (two benchmarks started together build the model once)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure_model(spec: ModelSpec, root: Path = RUN_DIR / "models") -> Path:
    """The model's directory, built first if missing or stale."""
    out = root / spec.name
    stamp = _stamp(spec)
    with _locked(root):
        if (out / "model.safetensors").exists() and _read(out / STAMP) == stamp:
            return out
        tmp = root / f".{spec.name}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"building the benchmark model {spec.name} in {out} (once)", flush=True)
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        cmd = [sys.executable, str(REPO / "scripts" / "tiny_model.py"), str(tmp), *spec.builder_args()]
        subprocess.run(cmd, cwd=REPO, env=env, check=True, timeout=BUILD_TIMEOUT_S, stdout=subprocess.DEVNULL)
        (tmp / STAMP).write_text(stamp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return out


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _config(model: Path) -> dict:
    return json.loads((Path(model) / "config.json").read_text())


def vocab_size(model: Path) -> int:
    return int(_config(model)["vocab_size"])


def kv_bytes_per_token(model: Path) -> int:
    """KV bytes one token takes in vLLM's cache (bf16), read from any checkpoint's config.json:
    ``--model`` may name a model that no ``ModelSpec`` describes."""
    cfg = _config(model)
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    return 2 * kv_heads * head_dim * BYTES_PER_ELEMENT * int(cfg["num_hidden_layers"])


def real_model_dir() -> Path:
    """Where the real model is: $KVLENS_REAL_MODEL, else $KVLENS_RUN_DIR/smollm2-135m."""
    named = os.environ.get("KVLENS_REAL_MODEL")
    if named:
        return Path(named)
    return Path(os.environ.get("KVLENS_RUN_DIR") or REPO / ".run") / "smollm2-135m"


def real_model(wait_s: float = REAL_MODEL_WAIT_S) -> Path:
    """The real model's directory once its files are there; waits ``wait_s`` for them (setup.sh
    replaces the directory in one rename), then stops the run saying how to make it."""
    path = real_model_dir()
    deadline = time.monotonic() + wait_s
    while not all((path / f).exists() for f in ("config.json", "model.safetensors", "tokenizer.json")):
        if time.monotonic() >= deadline:
            raise SystemExit(f"no real model in {path}: run scripts/setup.sh (or set KVLENS_REAL_MODEL)")
        time.sleep(2.0)
    return path


def context_length(model: Path) -> int:
    """The longest sequence the checkpoint allows (vLLM refuses a longer --max-model-len)."""
    return int(_config(model)["max_position_embeddings"])


def check_fits(model: Path, max_model_len: int) -> None:
    """Stops the run when the workload's longest request does not fit the model's context."""
    limit = context_length(model)
    if max_model_len > limit:
        raise SystemExit(
            f"the workload needs --max-model-len {max_model_len}, more than {model.name}'s context of "
            f"{limit} tokens: shorten the prompts"
        )
