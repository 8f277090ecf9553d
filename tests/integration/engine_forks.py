"""Offline engines in fresh processes forked from one that has imported vLLM once.

Every offline engine of the tests runs in a process of its own (``run_engine.py``), so that no
engine sees another's state. Starting Python and importing torch and vLLM costs about 7-9
CPU-seconds here, most of an offline engine's start and, over the suite, minutes of the two
cores. A fork server (the standard library's ``forkserver``, one per pytest process) imports
vLLM once and forks a process per engine: each still starts no engine, connector or thread of
another, but skips the imports. KVLens's own modules are not preloaded; each engine imports them
afresh, from the working tree.

``KVLENS_TEST_ENGINE_FORKS=0`` runs each engine as a new interpreter instead.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRELOAD = ["vllm", "vllm.entrypoints.llm", "vllm.v1.engine.core"]
_context: multiprocessing.context.BaseContext | None = None


def enabled() -> bool:
    return os.environ.get("KVLENS_TEST_ENGINE_FORKS", "1") != "0"


def _fork_server() -> multiprocessing.context.BaseContext:
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        _context = context
    return _context


def _engine(runner: str, spec_file: str, env: dict[str, str], out: str) -> None:
    """In the forked process: the engine's environment, its output to ``out``, then the runner
    (which ends the process itself, ``os._exit``, once its result is printed)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(REPO)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.argv = [runner, spec_file]
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import runpy

    runpy.run_path(runner, run_name="__main__")


def run(runner: Path, spec_file: Path, env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Runs ``runner spec_file`` in a forked process -> (exit code, its stdout and stderr).
    TimeoutError when it outlives ``timeout`` (the process is killed)."""
    out = spec_file.with_suffix(".out")
    process = _fork_server().Process(
        target=_engine, args=(str(runner), str(spec_file), env, str(out)), daemon=False
    )
    process.start()
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join(10)
        raise TimeoutError(f"engine run outlived {timeout}s:\n{out.read_text(errors='replace')[-6000:]}")
    return process.exitcode or 0, out.read_text(errors="replace")
