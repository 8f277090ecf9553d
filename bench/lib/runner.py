"""The command-line options every benchmark shares, and the run that measures modes side by side.

A run starts the servers of several modes together (as many as memory allows, ``--max-live``),
then measures them in turns, one request stream at a time, reversing the order on every
repetition, so that whatever else the machine does at that moment weighs on every mode alike.
Servers that wait for their turn are idle (vLLM's engine blocks on its input queue). Every
server is stopped at the end, on errors and on SIGTERM/SIGHUP.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from . import report
from .client import Client
from .models import BENCH, TINY, ModelSpec, ensure_model
from .modes import Mode, Settings, kv_transfer_config, lmcache_venv_problem, parse_modes
from .paths import REPO, RUN_DIR, peers_tmp
from .servers import LMCACHE_ENV, LMCacheServer, VllmServer, server_env

GB = 1e9
SERVER_FOOTPRINT_GB = 2.6  # API server + engine core + worker processes, measured idle (RSS)
MEMORY_MARGIN_GB = 3.0  # left to the rest of the machine
NOISE_NOTE = (
    "Timings come from a small shared machine: compare the ratios measured side by side in this run, "
    "not absolute times across runs."
)


@dataclass(frozen=True, slots=True)
class ServerShape:
    """What every server of one workload shares."""

    max_model_len: int
    kv_blocks: int | None = None  # --num-gpu-blocks-override for every mode but the ceiling
    kv_space_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE (whole GiB), the same in every mode
    working_set_gb: float = 1.0  # what a connector ends up holding (for the memory estimate)


@dataclass
class LiveMode:
    mode: Mode
    server: VllmServer
    client: Client
    sidecar: LMCacheServer | None = None


def add_common_args(p: argparse.ArgumentParser, modes: str, quick_modes: str) -> None:
    g = p.add_argument_group("modes and run (shared by every benchmark)")
    g.add_argument("--quick", action="store_true", help="tiny model, few requests: keeps the script working")
    g.add_argument(
        "--modes",
        help=f"comma-separated (default {modes}; with --quick {quick_modes}); "
        "known: none, ceiling, kvlens (one per --kvlens-tiers), kvlens-<tier>, example, lmcache",
    )
    g.add_argument(
        "--kvlens-tiers", default="cpu,disk", help="KVLens tiers to run, one mode each (cpu,disk,remote)"
    )
    g.add_argument("--kvlens-chunk-size", type=int, default=256)
    g.add_argument("--kvlens-cpu-gb", type=float, default=4.0, help="KVLens CPU tier budget")
    g.add_argument("--kvlens-remote-url", help="remote tier URL for --kvlens-tiers remote")
    g.add_argument(
        "--lmcache-chunk-size",
        type=int,
        default=128,
        help="LMCache chunk size (128 = vLLM's CPU block: its best case here; 256 is its default)",
    )
    g.add_argument(
        "--lmcache-setup",
        choices=("auto", "yes", "no"),
        default="auto",
        help="build LMCache's virtualenv when missing (auto: yes in full runs, no with --quick)",
    )
    g.add_argument("--lmcache-venv", type=Path, default=peers_tmp() / "venv-lmcache")
    g.add_argument("--model", type=Path, help="model directory (default: built under .run/bench/models)")
    g.add_argument("--out", type=Path, default=RUN_DIR / "results", help="where the JSON and PNG go")
    g.add_argument("--max-live", type=int, help="servers running at once (default: as many as memory allows)")
    g.add_argument("--startup-timeout", type=float, default=420.0, help="seconds for one server to start")
    g.add_argument(
        "--keep-storage", action="store_true", help="keep the disk tier and ExampleConnector files"
    )


def fill_defaults(args: argparse.Namespace, quick: dict[str, Any], full: dict[str, Any]) -> None:
    """Options left unset take the --quick or the full run's value."""
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)


class Run:
    """One benchmark run: its settings, modes, servers, notes and output files."""

    def __init__(
        self,
        workload: str,
        args: argparse.Namespace,
        default_modes: str,
        quick_modes: str,
        full_spec: ModelSpec = BENCH,
    ) -> None:
        """``full_spec``: the model of a full run (--quick always runs the tiny one), for a
        workload that needs another context length than ``BENCH``'s."""
        self.workload = workload
        self.args = args
        self.quick = bool(args.quick)
        self.spec: ModelSpec = TINY if self.quick else full_spec
        self.model = args.model or ensure_model(self.spec)
        self.modes = parse_modes(
            args.modes or (quick_modes if self.quick else default_modes), args.kvlens_tiers
        )
        self.work_dir = RUN_DIR / "runs" / f"{workload}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self.settings = Settings(
            storage_dir=self.work_dir / "storage",
            kvlens_chunk_size=args.kvlens_chunk_size,
            kvlens_cpu_gb=args.kvlens_cpu_gb,
            kvlens_remote_url=args.kvlens_remote_url,
            lmcache_chunk_size=args.lmcache_chunk_size,
            lmcache_venv=args.lmcache_venv,
        )
        self.notes: list[str] = []
        self.skipped: dict[str, str] = {}
        self.started = time.time()
        self.load_before = os.getloadavg()
        self._lmcache_checked = False

    # ---- notes and header ---------------------------------------------------------------
    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"NOTE: {text}", flush=True)

    def header(self, what: str) -> None:
        names = ", ".join(m.name for m in self.modes)
        print(f"== {self.workload}: {what}", flush=True)
        print(
            f"   model {self.model} ({'--quick' if self.quick else 'full run'}); modes: {names}", flush=True
        )
        load = ", ".join(f"{x:.2f}" for x in self.load_before)
        print(f"   {os.cpu_count()} CPUs, load average {load}; logs in {self.work_dir}", flush=True)

    # ---- servers ------------------------------------------------------------------------
    def batches(self, shape: ServerShape) -> Iterator[list[LiveMode]]:
        """The modes' servers, started a batch at a time; stopped when the caller moves on."""
        modes = [m for m in self.modes if self._runnable(m)]
        size = self._max_live(shape, modes)
        if size < len(modes):
            self.note(
                f"{size} servers at a time (memory): modes in different batches were not measured in turns"
            )
        for i in range(0, len(modes), size):
            with self.servers(modes[i : i + size], shape) as live:
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

    def unavailable(self, mode: Mode) -> str:
        """A table's row text for a mode that has no figures."""
        return f"unavailable: {report.first_line(self.skipped.get(mode.name, 'not measured'), 140)}"

    def skip(self, mode: Mode, why: str) -> None:
        self.skipped[mode.name] = why
        self.note(f"mode {mode.name} skipped: {why}")

    def _max_live(self, shape: ServerShape, modes: Sequence[Mode]) -> int:
        if self.args.max_live:
            return max(1, self.args.max_live)
        avail = _mem_available_gb() - MEMORY_MARGIN_GB
        weights = sum(f.stat().st_size for f in Path(self.model).glob("*.safetensors")) / GB
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
    def servers(self, modes: Sequence[Mode], shape: ServerShape) -> Iterator[list[LiveMode]]:
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
                    self.skip(
                        lm.mode,
                        f"its vLLM server did not start ({str(e).splitlines()[0]}); log {lm.server.log_path}",
                    )
                    _stop(lm)
                    live.remove(lm)
            print(
                f"   {len(live)} server(s) ready after {time.monotonic() - t0:.0f} s: "
                f"{', '.join(lm.mode.name for lm in live)}",
                flush=True,
            )
            yield live
        finally:
            for lm in reversed(live):
                _stop(lm)

    def _start(self, mode: Mode, shape: ServerShape) -> LiveMode | None:
        env = server_env(shape.kv_space_gib, LMCACHE_ENV if mode.connector == "lmcache" else None)
        python, sidecar = sys.executable, None
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
            sidecar.start()
            try:
                sidecar.wait_until(sidecar.ready, time.monotonic() + 180)
            except (RuntimeError, TimeoutError) as e:
                sidecar.stop()
                self.skip(mode, f"LMCache's server did not start ({str(e).splitlines()[0]})")
                return None
        for sub in ("kvlens-disk", "example-connector"):
            (self.settings.storage_dir / sub).mkdir(parents=True, exist_ok=True)
        ktc = kv_transfer_config(mode, self.settings, sidecar.port if sidecar else None)
        args = (
            []
            if mode.ceiling or shape.kv_blocks is None
            else ["--num-gpu-blocks-override", str(shape.kv_blocks)]
        )
        server = VllmServer(
            mode.name,
            python,
            Path(self.model),
            shape.max_model_len,
            ktc,
            args,
            env,
            self.work_dir / f"{mode.name}.log",
        )
        server.start()
        return LiveMode(mode, server, Client(server.url), sidecar)

    # ---- results ------------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "argv": sys.argv[1:],
            "quick": self.quick,
            "model": {"path": str(self.model), "spec": None if self.args.model else self.spec.__repr__()},
            "modes": [m.name for m in self.modes],
            "skipped": self.skipped,
            "notes": self.notes,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.started)),
            "seconds": round(time.time() - self.started, 1),
            "cpus": os.cpu_count(),
            "load_average_before": self.load_before,
            "load_average_after": os.getloadavg(),
            "versions": {d: _version(d) for d in ("vllm-cpu", "vllm", "torch")},
            "python": platform.python_version(),
            "commit": _git_commit(),
            "pinned_env": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"},
            "work_dir": str(self.work_dir),
        }

    def finish(self, data: dict[str, Any], table: str, title: str, panels: list[report.Panel]) -> None:
        out = Path(self.args.out)
        json_path = out / f"{self.workload}.json"
        data = {"meta": self.meta(), **data}
        report.write_json(json_path, data)
        png = report.plot(out / f"{self.workload}.png", title, panels, footnote=self.footnote())
        if not self.args.keep_storage:
            shutil.rmtree(self.settings.storage_dir, ignore_errors=True)
        print()
        print(table)
        for text in self.notes:
            print(f"NOTE: {text}")
        print(NOISE_NOTE)
        print(f"wrote {json_path}" + (f" and {png}" if png else ""), flush=True)

    def footnote(self) -> str:
        load = "/".join(f"{x:.1f}" for x in self.load_before)
        skipped = "; ".join(f"{k} skipped" for k in self.skipped)
        parts = [
            f"{self.workload} {'--quick' if self.quick else ''}",
            f"model {Path(self.model).name}",
            f"{os.cpu_count()} CPUs, load {load} at start",
            time.strftime("%Y-%m-%d %H:%M"),
            skipped,
        ]
        return " | ".join(p for p in parts if p) + "\n" + NOISE_NOTE


def rotated(live: Sequence[LiveMode], rep: int) -> list[LiveMode]:
    """The order of turns in repetition ``rep``: as given, then reversed, and so on."""
    return list(live) if rep % 2 == 0 else list(reversed(live))


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP unwind like Ctrl-C, through the code that stops the servers."""

    def _exit(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, _exit) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _stop(lm: LiveMode) -> None:
    lm.server.stop()
    if lm.sidecar is not None:
        lm.sidecar.stop()


def _mem_available_gb() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / GB
    except OSError:
        pass
    return 8.0


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None
