"""vLLM servers (and LMCache's own server) as child process groups with bounded waits.

Each server runs in its own session, so stopping it reaches the API server, its engine core
and its workers together, whatever state they are in; every wait has a deadline, and what a
server printed is kept in a log file whose tail goes into the error when it fails to start.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

from .paths import REPO
from .ports import free_ports

STOP_GRACE_S = 30.0
POLL_S = 0.5
SERVED_MODEL_NAME = "bench"

# Settings every mode gets, so that each mode runs with the same worker cores and KV memory
# (REFERENCE.md section 2: vLLM-CPU reserves one more core when a connector is configured,
# which makes connector runs look up to 2x faster unless the reservation is pinned).
PINNED_ENV = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # One step may prefill a whole prompt on one core: 32k tokens of the bench model take more
    # than vLLM's default 300 s, after which the engine declares itself dead (seen in
    # prompt_scaling.py at 32,100 tokens, in every mode).
    "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "3600",
    "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
}
# For LMCache's server and its vLLM only: KVLens reads LMCACHE_<KEY> variables as its own
# configuration (as LMCache does) and refuses keys it does not know.
LMCACHE_ENV = {"LMCACHE_TRACK_USAGE": "false", "LMCACHE_DISABLE_BANNER": "1"}
# Lines after which a starting vLLM server never becomes ready, though its API server may
# take minutes to exit.
FATAL_MARKERS = (
    "Engine core initialization failed",
    "Worker failed with error",
    "EngineCore failed to start",
)


def server_env(kv_space_gib: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every server: this one without settings that would change a mode
    behind the benchmark's back (KVLens, LMCache and OpenTelemetry variables), plus the pins."""
    drop = ("OTEL_", "KVLENS_", "LMCACHE_", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto")
    env.update(PINNED_ENV)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_space_gib))  # vLLM wants whole GiB
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


class ManagedProcess:
    """A child process leading its own process group, with its output in a log file."""

    name = "process"

    def __init__(self, cmd: Sequence[str], env: dict[str, str], log_path: Path, cpus: set[int] | None = None):
        self.cmd = list(cmd)
        self.env = env
        self.log_path = log_path
        self.cpus = cpus
        self.proc: subprocess.Popen[bytes] | None = None
        self._scanned = 0  # bytes of the log already checked for fatal lines

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cpus = self.cpus
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                cwd=REPO,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        """The leader's pid, which is also its process group's id."""
        assert self.proc is not None, f"{self.name} was not started"
        return self.proc.pid

    def wait_until(self, ready: Callable[[], bool], deadline: float) -> None:
        """Polls ``ready`` until it says yes; raises if the process exits or the deadline passes."""
        while time.monotonic() < deadline:
            if not self.alive():
                code = self.proc.returncode if self.proc else None
                raise RuntimeError(f"{self.name} exited with {code} before it was ready:\n{self.log_tail()}")
            if ready():
                return
            fatal = self.fatal_line()
            if fatal:
                raise RuntimeError(f"{self.name} failed to start ({fatal}):\n{self.log_tail()}")
            time.sleep(POLL_S)
        raise TimeoutError(f"{self.name} not ready in time:\n{self.log_tail()}")

    def fatal_line(self) -> str | None:
        """A line of the log saying that the process will never become ready."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._scanned)
                data = f.read()
        except OSError:
            return None
        cut = data.rfind(b"\n") + 1  # whole lines only; the rest is read next time
        self._scanned += cut
        for line in data[:cut].decode(errors="replace").splitlines():
            if any(m in line for m in FATAL_MARKERS):
                return line.strip()[-300:]
        return None

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM to the leader (it stops its children), SIGKILL to the group after a grace period."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=grace_s)
        _wait_group_gone(proc.pid, timeout_s=5.0)
        signal_group(proc.pid, signal.SIGKILL)  # stragglers (engine core, workers, trackers)
        return proc.returncode

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """``sig`` to every process of group ``pgid`` (never to this process's own group)."""
    if pgid == os.getpgrp():
        return
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is left (a zombie counts until it is reaped)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and group_alive(pgid):
        time.sleep(0.1)


def http_ok(url: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
    try:
        with opener.open(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


# vLLM-CPU forces its multiprocess executor (a worker process of its own, spawned: a third
# process importing torch and vLLM, about 10 CPU-seconds of a start here) unless the engine core
# is told to run in-process; then a one-rank engine keeps the one-process executor, whose worker
# runs in the engine core. `vllm serve` still runs its engine core in a process of its own.
WORKER_IN_CORE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
WORKER_IN_CORE_ARGS = ("--distributed-executor-backend", "uni")


def cores_of(bind: str) -> list[int] | None:
    """The cores of a one-rank ``VLLM_CPU_OMP_THREADS_BIND`` such as ``1`` or ``0-1,3`` (None for
    ``auto``, ``nobind`` or one list per rank)."""
    if not bind or any(c not in "0123456789,-" for c in bind):
        return None
    cores: list[int] = []
    for part in bind.split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            return None
        cores += range(int(low), int(high or low) + 1)
    return cores


def in_engine_core(cmd: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """``cmd`` and ``env`` of a one-rank server whose worker runs in the engine core, with the
    worker's threads as vLLM's process split gives them. That split binds the worker's OpenMP
    threads, one per core of ``VLLM_CPU_OMP_THREADS_BIND`` (under ``auto``: the cores left after
    ``VLLM_CPU_NUM_OF_RESERVED_CPU``); the in-core worker is bound by nothing, so torch would run
    one spinning OpenMP thread per core of the machine beside the other test worker's engines (a
    real-model PD test took 7x its time alone) and sum in another order. Here it gets as many
    threads as the split would, on the same cores where the bind names them."""
    bind = env.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    cores = cores_of(bind)
    if cores is None:
        reserved = int(env.get("VLLM_CPU_NUM_OF_RESERVED_CPU") or 1)
        threads = max(1, len(os.sched_getaffinity(0)) - reserved)
    else:
        threads = len(cores)
        cmd = ["taskset", "-c", bind, *cmd]
    return [*cmd, *WORKER_IN_CORE_ARGS], {**env, **WORKER_IN_CORE_ENV, "OMP_NUM_THREADS": str(threads)}


WORKER_IN_CORE_HELP = (
    "run the model's worker in vLLM's engine core (one process fewer to start: for smoke tests; "
    "not vLLM-CPU as deployed, figures are not comparable)"
)


class VllmServer(ManagedProcess):
    """``vllm serve`` through ``connector.launcher`` (the vllm-cpu version shim)."""

    def __init__(
        self,
        name: str,
        python: str,
        model: Path,
        max_model_len: int,
        kv_transfer_config: dict[str, Any] | None,
        server_args: Sequence[str],
        env: dict[str, str],
        log_path: Path,
        dtype: str = "bfloat16",
        worker_in_core: bool = False,
    ) -> None:
        """``worker_in_core``: the model's worker runs in vLLM's engine core process instead of
        a process of its own (vLLM-CPU's default): one process fewer to start, for smoke tests;
        not vLLM as deployed, so its figures are not comparable."""
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [python, "-m", "connector.launcher", "serve", str(model)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--served-model-name", SERVED_MODEL_NAME, "--enforce-eager", "--dtype", dtype]
        cmd += ["--max-model-len", str(max_model_len), "--seed", "0", "--enable-prompt-tokens-details"]
        # One prompt, one prefill step, in every mode: vLLM's ExampleConnector saves what each
        # step computed and reloads it as one tensor, so a prompt split by chunked prefill
        # (2,048 tokens a step by default) kills its engine with a shape mismatch on the hit.
        cmd += ["--max-num-batched-tokens", str(max(max_model_len, 2048))]
        cmd += ["--disable-uvicorn-access-log"]
        if kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        cmd += list(server_args)
        if worker_in_core:
            cmd, env = in_engine_core(cmd, env)
        super().__init__(cmd, env, log_path)
        self.name = f"vLLM server ({name})"

    def ready(self) -> bool:
        return http_ok(self.url + "/health")


class LMCacheServer(ManagedProcess):
    """LMCache's own server for its multiprocess mode (the recipe in shared/peers/lmcache-mp):
    engine-driven transfer through a shared-memory pool, LRU eviction."""

    def __init__(
        self, lmcache_exe: Path, chunk_size: int, l1_size_gb: float, env: dict[str, str], log_path: Path
    ):
        self.port, self.http_port = free_ports(2)
        # LMCache 0.5.6 prefixes pool names with "lmcache_l1_pool_" unless they have it already;
        # the full name keeps the segment known for the clean-up in stop().
        self.shm_name = f"lmcache_l1_pool_bench_{os.getpid()}_{self.port}"
        cmd = [str(lmcache_exe), "server", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--http-host", "127.0.0.1", "--http-port", str(self.http_port)]
        cmd += ["--chunk-size", str(chunk_size), "--l1-size-gb", f"{l1_size_gb:g}"]
        cmd += ["--eviction-policy", "LRU", "--supported-transfer-mode", "engine_driven"]
        cmd += ["--shm-name", self.shm_name]
        allowed = sorted(os.sched_getaffinity(0))
        # Away from vLLM's worker: on the last core, the one vLLM reserves for its own processes.
        super().__init__(cmd, env, log_path, cpus={allowed[-1]} if len(allowed) > 1 else None)
        self.name = "LMCache server"

    def ready(self) -> bool:
        return http_ok(f"http://127.0.0.1:{self.http_port}/healthcheck")

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        code = super().stop(grace_s)
        try:  # the pool of a server that was killed
            seg = shared_memory.SharedMemory(name=self.shm_name)
        except (FileNotFoundError, OSError):
            return code
        seg.close()
        seg.unlink()
        return code


class RedisServer(ManagedProcess):
    """A private redis-server on a free loopback port, without persistence; ``start`` after
    ``stop`` brings it back on the same port (the soak's Redis restart)."""

    def __init__(self, workdir: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise SystemExit("redis-server is not installed (bash scripts/setup.sh), or pass a URL")
        self.port = free_ports(1)[0]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        workdir.mkdir(parents=True, exist_ok=True)
        cmd = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        cmd += ["--dir", str(workdir)]
        super().__init__(cmd, dict(os.environ), workdir / "redis.log")
        self.name = "redis-server"

    def start(self) -> None:
        super().start()
        self.wait_until(self.ready, time.monotonic() + 30)

    def ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False
