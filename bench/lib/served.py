"""Benchmarks whose modes are vLLM servers: one per mode (``modes.py``), started together, as many
as memory allows (``--max-live``), and measured in turns by the runner.

Servers that wait for their turn are idle (vLLM's engine blocks on its input queue). Every
server is stopped at the end, on errors and on SIGTERM/SIGHUP; a server that fails a request
leaves the run (reported unavailable from then on) and keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import report
from .client import Client
from .models import BENCH, REAL_HELP, TINY, ModelSpec, check_fits, ensure_model, real_model, vocab_size
from .modes import (
    Mode,
    Settings,
    kv_transfer_config,
    lmcache_disk_dir,
    lmcache_server_args,
    lmcache_venv_problem,
    parse_modes,
)
from .paths import RUN_DIR, peers_tmp
from .runner import Benchmark, Option, SideFailed
from .server_pool import PooledServer, ServerPool, signature
from .servers import (
    LMCACHE_ENV,
    WORKER_IN_CORE_HELP,
    LMCacheServer,
    ManagedProcess,
    VllmServer,
    group_alive,
    http_ok,
    server_env,
)

GB = 1e9
SERVER_FOOTPRINT_GB = 2.6  # API server + engine core + worker processes, measured idle (RSS)
MEMORY_MARGIN_GB = 3.0  # left to the rest of the machine


@dataclass(frozen=True, slots=True)
class ServerShape:
    """What every server of one workload shares."""

    max_model_len: int
    kv_blocks: int | None = None  # --num-gpu-blocks-override for every mode but the ceiling
    kv_space_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE (whole GiB), the same in every mode
    working_set_gb: float = 1.0  # what a connector ends up holding (for the memory estimate)
    dtype: str = field(default_factory=report.native_dtype)


@dataclass
class LiveMode:
    """A mode with its running server."""

    mode: Mode
    server: VllmServer | ReusedServer
    client: Client
    sidecar: LMCacheServer | None = None
    pooled: PooledServer | None = None  # with --server-pool: left running there at the end

    @property
    def name(self) -> str:
        return self.mode.name


class ServedBenchmark(Benchmark):
    """A benchmark over vLLM servers: define ``server_shape``; ``measure`` gets a ``LiveMode``."""

    default_modes = "none,kvlens,example,lmcache"
    quick_modes = default_modes
    kvlens_tiers = "cpu,disk"
    kvlens_cpu_gb = 4.0
    startup_timeout_s = 420.0
    full_spec: ModelSpec = BENCH  # the model of a full run (--quick runs the tiny one)
    failures = (SideFailed, OSError, TimeoutError)  # urllib's errors are OSErrors
    progress_each_turn = True

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        if args.real and args.model:
            raise SystemExit("--real and --model name two models: give one")
        self.spec: ModelSpec | None = None if args.real else TINY if self.quick else self.full_spec
        self.model = real_model() if args.real else Path(args.model or ensure_model(self.spec))
        self.work_dir = RUN_DIR / "runs" / f"{self.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self.settings = Settings(
            storage_dir=self.work_dir / "storage",
            kvlens_chunk_size=args.kvlens_chunk_size,
            kvlens_cpu_gb=args.kvlens_cpu_gb,
            kvlens_remote_url=args.kvlens_remote_url,
            lmcache_chunk_size=args.lmcache_chunk_size,
            lmcache_venv=args.lmcache_venv,
        )
        self._lmcache_checked = False
        self.pool = ServerPool(args.server_pool) if args.server_pool else None

    def server_shape(self) -> ServerShape:
        raise NotImplementedError

    @property
    def result_name(self) -> str:
        """``NAME-real`` with --real: the real model's figures do not replace the bench model's."""
        return f"{self.name}-real" if self.args.real else self.name

    @functools.cached_property
    def vocab(self) -> int:
        return vocab_size(self.model)

    def chosen_sides(self) -> list[Any]:
        spec = self.args.modes or (self.quick_modes if self.quick else self.default_modes)
        try:
            return parse_modes(spec, self.args.kvlens_tiers)
        except ValueError as e:
            raise SystemExit(f"--modes: {e}") from None

    def describe(self, side: Any) -> dict[str, Any]:
        return {"label": side.label, "connector": side.connector, "tier": side.tier, "ceiling": side.ceiling}

    def header(self) -> None:
        super().header()
        print(f"   model {self.model}; logs in {self.work_dir}", flush=True)

    def meta(self) -> dict[str, Any]:
        spec = "real" if self.args.real else None if self.args.model else repr(self.spec)
        pinned = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
        extra = {
            "model": {"path": str(self.model), "spec": spec},
            "pinned_env": pinned,
            "work_dir": str(self.work_dir),
        }
        return {**super().meta(), **extra}

    def alive(self, side: LiveMode) -> bool:
        return side.server.ready()

    def close_side(self, side: LiveMode) -> None:
        if self.pool is not None and side.pooled is not None:
            if side.server.ready():
                self.pool.give_back(side.pooled)  # running, for the next run
            else:
                side.server.stop()
                self.pool.drop(side.pooled)
        else:
            side.server.stop()
        if side.sidecar is not None:
            side.sidecar.stop()

    def skip(self, side: Any, why: str) -> None:
        log = getattr(getattr(side, "server", None), "log_path", None)
        super().skip(side, f"{why}; log {log}" if log else why)

    def report(self, records: Any) -> None:
        if not self.args.keep_storage:
            shutil.rmtree(self.settings.storage_dir, ignore_errors=True)
        super().report(records)

    # ---- servers ------------------------------------------------------------------------------
    def open_sides(self) -> Iterator[list[LiveMode]]:
        """The modes' servers, started a batch at a time; stopped when the caller moves on."""
        shape = self.server_shape()
        check_fits(self.model, shape.max_model_len)
        modes = [m for m in self.modes if self._runnable(m)]
        size = self._max_live(shape, modes)
        if size < len(modes):
            self.note(
                f"{size} servers at a time (memory): modes in different batches were not measured in turns"
            )
        for i in range(0, len(modes), size):
            with self._servers(modes[i : i + size], shape) as live:
                if live:
                    yield live

    def _runnable(self, mode: Mode) -> bool:
        if mode.connector != "lmcache":
            return True
        if not self._lmcache_checked:
            self._lmcache_checked = True
            setup = self.args.lmcache_setup
            build = setup == "yes" or (setup == "auto" and not self.quick)
            problem = lmcache_venv_problem(self.args.lmcache_venv, build)
            if problem:
                self.skip(mode, f"LMCache's virtualenv is not usable: {problem}")
        return mode.name not in self.skipped

    def _max_live(self, shape: ServerShape, modes: Sequence[Mode]) -> int:
        if self.args.max_live:
            return max(1, self.args.max_live)
        avail = _mem_available_gb() - MEMORY_MARGIN_GB
        weights = sum(f.stat().st_size for f in self.model.glob("*.safetensors")) / GB
        kv = shape.kv_space_gib * 1.074 if shape.kv_blocks is None else shape.kv_space_gib * 0.25
        need = 0.0
        for n, mode in enumerate(modes, start=1):
            need += SERVER_FOOTPRINT_GB + weights + kv + self._mode_extra_gb(mode, shape)
            if need > avail:
                return max(1, n - 1)
        return max(1, len(modes))

    def _mode_extra_gb(self, mode: Mode, shape: ServerShape) -> float:
        if mode.connector == "kvlens" and mode.tier == "cpu":
            return min(self.settings.kvlens_cpu_gb, shape.working_set_gb)
        if mode.connector == "lmcache":
            return self.settings.lmcache_l1_gb + 0.5
        return 0.0

    @contextlib.contextmanager
    def _servers(self, modes: Sequence[Mode], shape: ServerShape) -> Iterator[list[LiveMode]]:
        live: list[LiveMode] = []
        try:
            for mode in modes:
                started = self._start(mode, shape)
                if started is not None:
                    live.append(started)
            t0 = time.monotonic()
            deadline = t0 + self.args.startup_timeout * max(1.0, len(live) / 2)
            for lm in list(live):
                try:
                    lm.server.wait_until(lm.server.ready, deadline)
                except (RuntimeError, TimeoutError) as e:
                    if not lm.mode.optional:
                        raise
                    self.drop(live, lm, f"its vLLM server did not start ({str(e).splitlines()[0]})")
            names = ", ".join(lm.name for lm in live)
            print(f"   {len(live)} server(s) ready after {time.monotonic() - t0:.0f} s: {names}", flush=True)
            reused = [lm.name for lm in live if isinstance(lm.server, ReusedServer)]
            if reused:
                self.note(
                    f"servers reused from {self.pool.path}: {', '.join(reused)} (they keep what earlier "
                    "runs stored, and count it)"
                )
            yield live
        finally:
            for lm in reversed(live):
                self.close_side(lm)

    def _start(self, mode: Mode, shape: ServerShape) -> LiveMode | None:
        env = server_env(shape.kv_space_gib, LMCACHE_ENV if mode.connector == "lmcache" else None)
        python, sidecar = sys.executable, None
        for sub in ("kvlens-disk", "example-connector"):
            (self.settings.storage_dir / sub).mkdir(parents=True, exist_ok=True)
        lmcache_disk_dir(self.settings).mkdir(parents=True, exist_ok=True)
        if mode.connector == "lmcache":
            venv = self.args.lmcache_venv
            python = str(venv / "bin" / "python")
            sidecar = LMCacheServer(
                venv / "bin" / "lmcache",
                self.settings.lmcache_chunk_size,
                self.settings.lmcache_l1_gb,
                env,
                self.work_dir / f"{mode.name}-server.log",
            )
            sidecar.cmd += lmcache_server_args(mode, self.settings)
            sidecar.start()
            try:
                sidecar.wait_until(sidecar.ready, time.monotonic() + 180)
            except (RuntimeError, TimeoutError) as e:
                sidecar.stop()
                self.skip(mode, f"LMCache's server did not start ({str(e).splitlines()[0]})")
                return None
        ktc = kv_transfer_config(mode, self.settings, sidecar.port if sidecar else None)
        limit = mode.ceiling or shape.kv_blocks is None
        args = [] if limit else ["--num-gpu-blocks-override", str(shape.kv_blocks)]
        if not mode.prefix_caching:
            args.append("--no-enable-prefix-caching")
        log = self.work_dir / f"{mode.name}.log"
        server = VllmServer(
            mode.name,
            python,
            self.model,
            shape.max_model_len,
            ktc,
            args,
            env,
            log,
            shape.dtype,
            worker_in_core=self.args.worker_in_core,
        )
        pooled = self.pool is not None and sidecar is None  # LMCache's sidecar is not pooled
        if pooled:
            sig, max_len = signature(server.cmd, server.env)
            entry = self.pool.take(sig, max_len, lambda url: http_ok(url + "/health"))
            if entry is not None:
                reused = ReusedServer(mode.name, entry)
                return LiveMode(mode, reused, Client(reused.url), pooled=entry)
        server.start()
        live = LiveMode(mode, server, Client(server.url), sidecar)
        if pooled:
            live.pooled = PooledServer(sig, server.url, server.pid, max_len, str(log))
            self.pool.add(live.pooled)
        return live

    @classmethod
    def common_options(cls) -> dict[str, Option]:
        lmcache_chunk = "LMCache chunk size (128 = vLLM's CPU block: its best case here; 256 is its default)"
        return super().common_options() | {
            "kvlens_tiers": Option(
                cls.kvlens_tiers, help="KVLens tiers, one mode each for 'kvlens' in --modes"
            ),
            "kvlens_chunk_size": Option(256),
            "kvlens_cpu_gb": Option(cls.kvlens_cpu_gb, help="KVLens CPU tier budget"),
            "kvlens_remote_url": Option(None, help="remote tier URL for --kvlens-tiers remote"),
            "lmcache_chunk_size": Option(128, help=lmcache_chunk),
            "lmcache_setup": Option(
                "auto",
                help="build LMCache's virtualenv when missing (auto: yes in full runs, no with --quick)",
                choices=("auto", "yes", "no"),
            ),
            "lmcache_venv": Option(peers_tmp() / "venv-lmcache", type=Path),
            "model": Option(None, help="model directory (default: built under .run/bench/models)", type=Path),
            "real": Option(False, help=REAL_HELP),
            "max_live": Option(
                None, help="servers running at once (default: as many as memory allows)", type=int
            ),
            "startup_timeout": Option(cls.startup_timeout_s, help="seconds for one server to start"),
            "keep_storage": Option(False, help="keep the disk tier and ExampleConnector files"),
            "worker_in_core": Option(False, help=WORKER_IN_CORE_HELP),
            "server_pool": Option(
                None,
                help="reuse servers an earlier run left in this file (started alike) and leave this run's "
                "there, running (bench/lib/server_pool.py; for smoke tests: figures are not comparable)",
                type=Path,
            ),
        }


class ReusedServer(ManagedProcess):
    """A vLLM server an earlier run left in the pool: used as it is, never stopped here."""

    def __init__(self, name: str, entry: PooledServer) -> None:
        super().__init__([], {}, Path(entry.log))
        self.url, self.pgid = entry.url, entry.pgid
        self.port = int(entry.url.rsplit(":", 1)[1])
        self.name = f"vLLM server ({name}, reused)"

    @property
    def pid(self) -> int:
        return self.pgid

    def alive(self) -> bool:
        return group_alive(self.pgid)

    def ready(self) -> bool:
        return self.alive() and http_ok(self.url + "/health")

    def stop(self, grace_s: float = 0.0) -> int | None:
        return None  # the pool's owner stops it


def _mem_available_gb() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / GB
    except OSError:
        pass
    return 8.0
