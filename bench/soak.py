"""Soak and chaos: a real ``vllm serve`` with KVLens under 32 concurrent clients while its disk
tier (and optionally its Redis) is damaged, checked for wrong answers, failed requests and leaks.

    .venv/bin/python bench/soak.py [--quick] [--remote] [--connector kvlens|example] [--out r.json]

KVLens runs with a CPU tier of a few chunks (it evicts all the time) over a disk tier in a
temporary folder, and vLLM's own KV memory is a few dozen blocks, so shared documents keep
coming back from KVLens rather than from vLLM's prefix cache. Clients send short unique
questions on a few long shared documents (completions with token ids, chat with text),
streaming or not, and 10% of streams hang up mid-way. A chaos thread deletes and corrupts chunk
files, makes the folder read-only once for a few seconds, and with ``--remote`` stops and
restarts a private redis-server. Probe prompts answered cold before the soak are asked again
during and after it: greedy answers must be identical. After the clients drain, KVLens's leak
gauges must read 0. ``--connector example`` runs the same workload with vLLM's ExampleConnector
(no chaos), for comparison; its failures are reported, not raised. ``--connector none`` runs it on
vLLM alone (the baseline for latency and memory growth).

Results (JSON, also printed): requests, failures with a sample of errors, p50/p99 latency,
peak RSS of the server's process tree, faults injected, probe mismatches, failed loads counted
and the leak gauges after the drain. --quick takes ~30 s of load after a ~40 s start-up.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from soak_chaos import Chaos  # noqa: E402
from soak_client import Outcome, Request, Workload, send  # noqa: E402

from tests.telemetry.serve import VllmServer, base_env, kv_transfer_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LEAK_GAUGES = ("request_trackers", "load_specs", "pending_saves", "pinned_requests", "unfinished_requests")
CHUNK_TOKENS = 256
CHUNK_BYTES = 1024**2  # float32 tiny model: 256 tokens x 4 layers x 2 x 2 heads x 64 x 4 bytes
CPU_CHUNKS = 8  # the CPU tier holds 8 chunks; the documents alone are ~30
STARTUP_TIMEOUT_S = 600  # shared 2-core machines have taken over 4 minutes
VLLM_BLOCKS = 48  # vLLM's own KV: 48 blocks of 128 tokens, ~4 prompts at once
MODES = {
    "quick": {"seconds": 30, "docs": (1300, 1500, 1700), "chat_docs": (300,), "max_tokens": 8},
    "long": {"seconds": 600, "docs": (1100, 1300, 1500, 1700), "chat_docs": (250, 350), "max_tokens": 12},
}


def cpu_budget_bytes() -> int:
    return CPU_CHUNKS * CHUNK_BYTES


def tree_rss_bytes(pgid: int) -> int:
    """Resident bytes of every process in the server's process group (API server, engine, workers)."""
    return sum(rss_by_process(pgid).values())


def rss_by_process(pgid: int) -> dict[str, int]:
    """Resident bytes per process of the group, keyed by ``name:pid``."""
    out, page = {}, resource.getpagesize()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            out[f"{name}:{pid}"] = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue
    return out


class RssSampler(threading.Thread):
    def __init__(self, pgid: int, interval_s: float = 0.5) -> None:
        super().__init__(name="soak-rss", daemon=True)
        self.pgid, self.interval_s = pgid, interval_s
        self.peak = self.first = tree_rss_bytes(pgid)
        self.first_by_process = {k: round(v / 2**20) for k, v in rss_by_process(pgid).items()}
        self.history = [self.first]  # every sample, to tell growth that levels off from a leak
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.interval_s):
            self.history.append(tree_rss_bytes(self.pgid))
            self.peak = max(self.peak, self.history[-1])

    def timeline_mb(self, points: int = 10) -> list[int]:
        step = max(1, len(self.history) // points)
        return [round(b / 2**20) for b in self.history[::step] if b]

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)


def kv_config(connector: str, disk: Path, remote_url: str | None) -> dict[str, Any] | None:
    if connector == "none":  # vLLM alone: what the workload costs without any connector
        return None
    if connector == "example":
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(disk)},
        }
    extra: dict[str, Any] = {
        "chunk_size": CHUNK_TOKENS,
        "max_local_cpu_size": cpu_budget_bytes() / 1024**3,
        "local_disk": str(disk),
        "max_local_disk_size": 0.25,
        "extra_config": {"tier_timeout_s": 2.0},
    }
    if remote_url:
        extra["remote_url"] = remote_url
    return kv_transfer_config(**extra)


def kvlens_metrics(server: VllmServer) -> dict[str, Any]:
    """Failed-load counters and the leak gauges, summed over labels."""
    wanted = {
        "failed_load_requests": "vllm:kvlens_failed_load_requests_total",
        "failed_blocks": "vllm:kvlens_failed_blocks_total",
        "recomputed_tokens": "vllm:kvlens_recomputed_tokens_total",
        "failed_store_chunks": None,
        "loaded_tokens": "vllm:kvlens_load_tokens_total",
        "evictions": "vllm:kvlens_evictions_total",
        **{g: f"vllm:kvlens_{g}" for g in LEAK_GAUGES},
    }
    samples = server.samples()
    out: dict[str, Any] = {}
    for key, name in wanted.items():
        if name is None:
            continue
        values = [v for (n, _), v in samples.items() if n == name]
        out[key] = sum(values) if values else None
    out["failed_blocks_by_reason"] = {
        dict(ls).get("reason", "?"): v
        for (n, ls), v in samples.items()
        if n == "vllm:kvlens_failed_blocks_total"
    }
    out["failed_chunks"] = {
        "/".join(dict(ls).get(k, "?") for k in ("operation", "tier", "reason")): v
        for (n, ls), v in samples.items()
        if n == "vllm:kvlens_failed_chunks_total"
    }
    return out


def leaks_drained(server: VllmServer, timeout_s: float = 30.0) -> dict[str, Any]:
    """Leak gauges once they read 0, or their last values after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = kvlens_metrics(server)
        gauges = {g: m[g] for g in LEAK_GAUGES}
        if all(not v for v in gauges.values()) or time.monotonic() > deadline:
            return gauges
        time.sleep(0.5)


class Clients:
    """``n`` threads sending drawn requests until ``stop``; outcomes are kept per request."""

    def __init__(self, port: int, workload: Workload, n: int, seed: int, alive: Callable[[], bool]) -> None:
        self.port, self.workload, self.alive = port, workload, alive
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._unique = itertools.count()
        self._halt = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(random.Random(seed * 1000 + i),), daemon=True)
            for i in range(n)
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._halt.set()
        for t in self._threads:
            t.join(timeout=200)

    def _run(self, rng: random.Random) -> None:
        while not self._halt.is_set() and self.alive():  # a dead server would only add refusals
            with self._lock:
                unique = next(self._unique)
            outcome = send(self.port, self.workload.draw(rng, unique))
            with self._lock:
                self.outcomes.append(outcome)


def ask_probes(port: int, probes: list[Request], reference: list[str] | None) -> tuple[list[str], list[dict]]:
    answers, mismatches = [], []
    for i, probe in enumerate(probes):
        out = send(port, probe)
        answers.append(out.text)
        if not out.ok:
            mismatches.append({"probe": i, "error": out.error})
        elif reference is not None and out.text != reference[i]:
            mismatches.append({"probe": i, "got": out.text, "want": reference[i], "kv": out.kv})
    return answers, mismatches


class ProbeLoop(threading.Thread):
    def __init__(self, port: int, probes: list[Request], reference: list[str], interval_s: float) -> None:
        super().__init__(name="soak-probes", daemon=True)
        self.port, self.probes, self.reference, self.interval_s = port, probes, reference, interval_s
        self.asked = 0
        self.mismatches: list[dict] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.interval_s):
            _, bad = ask_probes(self.port, self.probes, self.reference)
            self.asked += len(self.probes)
            self.mismatches += bad

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=300)


def latency_ms(outcomes: list[Outcome], q: float) -> float | None:
    times = sorted(o.seconds for o in outcomes if o.ok and not o.hung_up)
    if not times:
        return None
    if len(times) == 1:
        return times[0] * 1000
    return statistics.quantiles(times, n=100, method="inclusive")[int(q) - 1] * 1000


def run(
    connector: str = "kvlens",
    quick: bool = True,
    remote: bool = False,
    seconds: float | None = None,
    clients: int = 32,
    seed: int = 0,
    model: str | None = None,
    workdir: Path | None = None,
) -> dict[str, Any]:
    mode = MODES["quick" if quick else "long"]
    seconds = seconds or mode["seconds"]
    model = model or os.environ.get("KVLENS_TINY_MODEL") or str(REPO / ".run" / "tiny-model")
    own_tmp = workdir is None
    workdir = Path(workdir or tempfile.mkdtemp(prefix="kvlens-soak-"))
    disk = workdir / "kv"
    disk.mkdir(parents=True, exist_ok=True)
    redis_server = None
    if remote and connector == "kvlens":
        from tests.redis.servers import RedisServer

        redis_server = RedisServer(workdir / "redis").start()
    workload = Workload(mode["docs"], mode["chat_docs"], mode["max_tokens"])
    probes = workload.probes()
    args = ("--dtype", "float32", "--max-model-len", "2048", "--num-gpu-blocks-override", str(VLLM_BLOCKS))
    env = base_env(KVLENS_EVENT_LOG=str(workdir / "events.jsonl"))
    kv = kv_config(connector, disk, redis_server.url if redis_server else None)
    server = VllmServer(model, kv, workdir / "serve.log", env, args)
    result: dict[str, Any] = {"connector": connector, "mode": "quick" if quick else "long", "remote": remote}
    result.update({"seconds": seconds, "clients": clients, "workdir": str(workdir)})
    chaos: Chaos | None = None
    try:
        started = time.monotonic()
        server.wait_ready(STARTUP_TIMEOUT_S)
        result["startup_s"] = round(time.monotonic() - started, 1)
        reference, bad = ask_probes(server.port, probes, None)
        result["reference_errors"] = bad
        rss = RssSampler(server.proc.pid)
        rss.start()
        if connector == "kvlens":
            restart = None
            if redis_server is not None:

                def restart() -> None:
                    redis_server.stop()
                    time.sleep(3)
                    redis_server.start()

            chaos = Chaos(disk, seconds, seed=seed, restart_remote=restart)
        load = Clients(server.port, workload, clients, seed, lambda: server.proc.poll() is None)
        prober = ProbeLoop(server.port, probes, reference, interval_s=max(2.0, seconds / 10))
        began = time.monotonic()
        load.start()
        prober.start()
        if chaos:
            chaos.start()
        time.sleep(seconds)
        if chaos:
            chaos.stop()
        load.stop()
        prober.stop()
        result["soak_s"] = round(time.monotonic() - began, 1)
        outcomes = load.outcomes
        failures = [o for o in outcomes if not o.ok]
        result.update(
            {
                "requests": len(outcomes),
                "hung_up": sum(o.hung_up for o in outcomes),
                "failures": len(failures),
                "failure_samples": sorted({o.error for o in failures})[:5],
                "p50_ms": latency_ms(outcomes, 50),
                "p99_ms": latency_ms(outcomes, 99),
                "rss_at_start_mb": round(rss.first / 2**20),
                "peak_rss_mb": round(rss.peak / 2**20),
                "rss_timeline_mb": rss.timeline_mb(),
                "rss_by_process_mb_at_start": rss.first_by_process,
                "cpu_budget_mb": cpu_budget_bytes() // 2**20 if connector == "kvlens" else None,
                "faults": dict(chaos.faults) if chaos else {},
                "chaos_errors": chaos.errors if chaos else [],
                "probe_mismatches": prober.mismatches,
                "server_alive": server.proc.poll() is None,
            }
        )
        server.reset_prefix_cache()  # the last probes are served by KVLens (or recomputed), not vLLM
        _, after = ask_probes(server.port, probes, reference)
        result["probes_asked"] = len(probes) * 2 + prober.asked
        result["probe_mismatches"] += after
        result["leak_gauges_after_drain"] = leaks_drained(server) if connector == "kvlens" else {}
        result["metrics"] = kvlens_metrics(server) if connector == "kvlens" else {}
        rss.stop()
        result["peak_rss_mb"] = round(rss.peak / 2**20)
        result["rss_by_process_mb_at_end"] = {
            k: round(v / 2**20) for k, v in rss_by_process(server.proc.pid).items()
        }
    except Exception as e:  # e.g. the ExampleConnector's server dying: a result, not a crash
        result["error"] = repr(e)[:2000]
        result["server_alive"] = server.proc.poll() is None
        log = server.log_tail(10**7)
        first = log.find("Traceback")  # the root cause, not the cascade of errors after it
        result["log_excerpt"] = log[first : first + 8000] if first >= 0 else log[-4000:]
        cause = re.search(r"\] ([\w.]*(?:Error|Exception)\b.*)", log[max(first, 0) :])
        result["root_cause"] = cause.group(1)[:500] if cause else None
    finally:
        if chaos is not None:
            chaos.stop()  # the folder is writable again before anything is removed
        server.stop()
        if redis_server is not None:
            redis_server.kill()
        if own_tmp:
            shutil.rmtree(workdir, ignore_errors=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="~30 s of load instead of 10 minutes")
    p.add_argument("--seconds", type=float, help="length of the load phase (overrides the mode)")
    p.add_argument("--remote", action="store_true", help="add a private redis-server as remote tier")
    p.add_argument("--connector", choices=("kvlens", "example", "none"), default="kvlens")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the JSON results here")
    a = p.parse_args()
    result = run(a.connector, a.quick, a.remote, a.seconds, a.clients, a.seed)
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
