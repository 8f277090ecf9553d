"""Soak and chaos: a real ``vllm serve`` with KVLens under 32 concurrent clients while its disk
tier (and optionally its Redis) is damaged, checked for wrong answers, failed requests and leaks.

    .venv/bin/python bench/soak.py [--quick] [--remote] [--connector kvlens|example|none] [--seconds S]

KVLens runs with a CPU tier of a few chunks (it evicts all the time) over a disk tier (mode
``kvlens-cpu-disk``), and vLLM's own KV memory is a few dozen blocks, so shared documents keep
coming back from KVLens rather than from vLLM's prefix cache. Clients send short unique
questions on a few long shared documents (completions with token ids, chat with text),
streaming or not, and 10% of streams hang up mid-way. A chaos thread deletes and corrupts chunk
files, makes the folder read-only once for a few seconds, and with ``--remote`` stops and
restarts a private redis-server. Probe prompts answered cold before the soak are asked again
during and after it; every answer that differs from the cold one is asked again once the load is
gone, cold and then as vLLM's own prefix hit: an answer vLLM's own hit gives too is a near tie
(a hit and a one-pass prefill compute in another order), one it does not is wrong KV
(``wrong_kv``, which must be 0). After the clients drain, KVLens's leak gauges must read 0.
``--connector example`` (an alias of --modes) runs the same workload with
vLLM's ExampleConnector (no chaos), for comparison; its failures are reported, not raised.
``--connector none`` runs it on vLLM alone (the baseline for latency and memory growth);
several modes run one after the other.

Reported per mode: requests, failures with a sample of errors, p50/p99 latency, RSS growth and
peak of the server's process tree, faults injected, probe mismatches, failed loads counted and
the leak gauges after the drain (all in the JSON's raw record). --quick takes ~30 s of load
after a ~40 s start-up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import random
import re
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from soak_chaos import Chaos  # noqa: E402
from soak_client import Outcome, Request, Workload, send  # noqa: E402

from bench.lib.client import Client, metric_samples  # noqa: E402
from bench.lib.models import TINY  # noqa: E402
from bench.lib.modes import kvlens_disk_dir  # noqa: E402
from bench.lib.runner import Figure, Option, main  # noqa: E402
from bench.lib.served import LiveMode, ServedBenchmark, ServerShape  # noqa: E402
from bench.lib.servers import RedisServer  # noqa: E402

LEAK_GAUGES = ("request_trackers", "load_specs", "pending_saves", "pinned_requests", "unfinished_requests")
COUNTERS = {
    "failed_load_requests": "vllm:kvlens_failed_load_requests_total",
    "failed_blocks": "vllm:kvlens_failed_blocks_total",
    "recomputed_tokens": "vllm:kvlens_recomputed_tokens_total",
    "loaded_tokens": "vllm:kvlens_load_tokens_total",
    "evictions": "vllm:kvlens_evictions_total",
}
CHUNK_BYTES = 1024**2  # float32 tiny model: 256 tokens x 4 layers x 2 x 2 heads x 64 x 4 bytes
CPU_CHUNKS = 8  # the CPU tier holds 8 chunks; the documents alone are ~30
VLLM_BLOCKS = 48  # vLLM's own KV: 48 blocks of 128 tokens, ~4 prompts at once
WORKLOADS = {
    "quick": {"docs": (1300, 1500, 1700), "chat_docs": (300,), "max_tokens": 8},
    "long": {"docs": (1100, 1300, 1500, 1700), "chat_docs": (250, 350), "max_tokens": 12},
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


class Repeat(threading.Thread):
    """Calls ``step`` every ``interval_s`` (0: back to back) until ``stop``, or until it returns False."""

    def __init__(self, step: Callable[[], object], interval_s: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.step, self.interval_s = step, interval_s
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.interval_s) and self.step() is not False:
            pass

    def stop(self, timeout_s: float = 300.0) -> None:
        self._halt.set()
        self.join(timeout=timeout_s)


def kvlens_metrics(client: Client) -> dict[str, Any]:
    """Failed-load counters and the leak gauges, summed over labels."""
    samples = metric_samples(client.metrics_text())

    def total(name: str) -> float | None:
        values = [v for n, _, v in samples if n == name]
        return sum(values) if values else None

    def by(name: str, labels: tuple[str, ...]) -> dict[str, float]:
        out: dict[str, float] = {}
        for n, have, v in samples:
            if n == name:
                key = "/".join(have.get(k, "?") for k in labels)
                out[key] = out.get(key, 0.0) + v
        return out

    out: dict[str, Any] = {key: total(name) for key, name in COUNTERS.items()}
    out |= {g: total(f"vllm:kvlens_{g}") for g in LEAK_GAUGES}
    out["failed_blocks_by_reason"] = by("vllm:kvlens_failed_blocks_total", ("reason",))
    out["failed_chunks"] = by("vllm:kvlens_failed_chunks_total", ("operation", "tier", "reason"))
    return out


def leaks_drained(client: Client, timeout_s: float = 30.0) -> dict[str, Any]:
    """Leak gauges once they read 0, or their last values after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = kvlens_metrics(client)
        gauges = {g: m[g] for g in LEAK_GAUGES}
        if all(not v for v in gauges.values()) or time.monotonic() > deadline:
            return gauges
        time.sleep(0.5)


def clients(port: int, workload: Workload, n: int, seed: int, alive: Callable[[], bool]) -> tuple[list, list]:
    """``n`` threads sending drawn requests while the server lives (a dead one would only add
    refusals), not started; and the list their outcomes go to."""
    outcomes: list[Outcome] = []
    unique = itertools.count()

    def client(rng: random.Random) -> Callable[[], bool]:
        return lambda: outcomes.append(send(port, workload.draw(rng, next(unique)))) or alive()

    return [Repeat(client(random.Random(seed * 1000 + i))) for i in range(n)], outcomes


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


def verdict(port: int, probe: Request, mismatch: dict[str, Any]) -> dict[str, Any]:
    """Why a probe answered otherwise than cold, asked again once the load is gone.

    A hit computes only the prompt's tail over cached KV; a one-pass cold prefill computes
    everything at once, in another order, and where the top two tokens nearly tie the two can
    pick differently. vLLM's own prefix hit on the same prompt (its KV computed cold, just now)
    computes exactly as a KVLens hit does, so: an answer that vLLM's own hit gives too is a near
    tie; one it does not give is wrong KV. The mismatch's ``kv`` says what KVLens loaded for it.
    """
    cold = send(port, dataclasses.replace(probe, stream=False, hang_up_after=0, prompt_logprobs=1))
    own_hit = send(port, dataclasses.replace(probe, stream=False, hang_up_after=0))
    usage = (own_hit.kv or {}).get("kvlens") or {}
    out = {
        "probe": mismatch["probe"],
        "cold_again_is_reference": cold.ok and cold.text == mismatch["want"],
        "vllm_hit_answer": own_hit.text,
        "vllm_hit_cached_tokens": usage.get("vllm_cached_tokens"),
        "vllm_hit_loaded_tokens": usage.get("loaded_tokens"),
        "kvlens_usage_of_the_mismatch": (mismatch.get("kv") or {}).get("kvlens"),
    }
    out["verdict"] = "near_tie" if own_hit.ok and own_hit.text == mismatch["got"] else "wrong_kv"
    return out


def latency_ms(outcomes: list[Outcome], q: float) -> float | None:
    times = sorted(o.seconds for o in outcomes if o.ok and not o.hung_up)
    if not times:
        return None
    if len(times) == 1:
        return times[0] * 1000
    return statistics.quantiles(times, n=100, method="inclusive")[int(q) - 1] * 1000


def root_cause(log: str) -> dict[str, Any]:
    """The log from its first traceback (not the cascade of errors after it), and its error line."""
    first = log.find("Traceback")
    cause = re.search(r"\] ([\w.]*(?:Error|Exception)\b.*)", log[max(first, 0) :])
    excerpt = log[first : first + 8000] if first >= 0 else log[-4000:]
    return {"log_excerpt": excerpt, "root_cause": cause.group(1)[:500] if cause else None}


class Soak(ServedBenchmark):
    name = "soak"
    title = "soak and chaos: concurrent clients while the connector's storage is damaged"
    figures = (
        Figure("requests", "requests", "{:.0f}"),
        Figure("failures", "failed", "{:.0f}"),
        Figure("hung_up", "hung up", "{:.0f}", plot=False),
        Figure("p50_ms", "p50 ms", "{:.0f}", panel="latency, ms"),
        Figure("p99_ms", "p99 ms", "{:.0f}", panel="latency, ms"),
        Figure("rss_growth_mb", "RSS growth MiB", "{:.0f}"),
        Figure("peak_rss_mb", "peak RSS MiB", "{:.0f}", plot=False),
        Figure("probe_mismatch_count", "probe mismatches", "{:.0f}", plot=False),
        Figure("wrong_kv", "mismatches vLLM's own hit does not give", "{:.0f}", plot=False),
        Figure("faults_injected", "faults", "{:.0f}", plot=False),
        Figure("failed_load_requests", "failed loads", "{:.0f}", plot=False),
        Figure("leaks_after_drain", "leak gauges", "{:.0f}", plot=False),
    )
    default_modes = quick_modes = "kvlens"
    mode_flags = ("--connector",)
    kvlens_tiers = "cpu-disk"
    kvlens_cpu_gb = cpu_budget_bytes() / 1024**3
    startup_timeout_s = 600.0  # shared 2-core machines have taken over 4 minutes
    full_spec = TINY
    repeats = (1, 1)
    options = {
        "seconds": Option(600.0, 30.0, "length of the load phase"),
        "remote": Option(False, help="add a private redis-server as remote tier"),
        "clients": Option(32),
    }

    def __init__(self, args: Any) -> None:
        super().__init__(args)
        self.work = WORKLOADS["quick" if self.quick else "long"]
        self.seconds = args.seconds
        extra = {"tier_timeout_s": 2.0}
        self.settings = dataclasses.replace(self.settings, kvlens_disk_gb=0.25, kvlens_extra_config=extra)
        self.redis: RedisServer | None = None

    def server_shape(self) -> ServerShape:
        return ServerShape(2048, VLLM_BLOCKS, kv_space_gib=1, dtype="float32")

    @contextlib.contextmanager
    def setup(self) -> Iterator[None]:
        if self.args.remote:
            self.redis = RedisServer(self.work_dir / "redis")
            self.redis.start()
            self.settings = dataclasses.replace(self.settings, kvlens_remote_url=self.redis.url)
        try:
            yield
        finally:
            if self.redis is not None:
                self.redis.stop(grace_s=5)

    def restart_redis(self) -> None:
        assert self.redis is not None
        self.redis.stop(grace_s=5)
        time.sleep(3)
        self.redis.start()

    def measure(self, lm: LiveMode, case: Any, rep: int) -> dict[str, Any]:
        rec: dict[str, Any] = {"seconds": self.seconds, "clients": self.args.clients}
        try:
            self.soak(lm, rec)
        except (OSError, TimeoutError, RuntimeError) as e:  # e.g. the ExampleConnector's engine dying
            rec["error"] = repr(e)[:2000]
            rec["server_alive"] = lm.server.alive()
            rec |= root_cause(lm.server.log_tail(10**7))
        return rec

    def soak(self, lm: LiveMode, rec: dict[str, Any]) -> None:
        """Load, chaos and probes against one server; fills ``rec`` as it goes."""
        kvlens, port = lm.mode.connector == "kvlens", lm.server.port
        workload = Workload(self.work["docs"], self.work["chat_docs"], self.work["max_tokens"])
        probes = workload.probes()
        reference, rec["reference_errors"] = ask_probes(port, probes, None)
        pgid = lm.server.pid
        rss_at_start = {k: round(v / 2**20) for k, v in rss_by_process(pgid).items()}
        rss = [tree_rss_bytes(pgid)]  # every sample, to tell growth that levels off from a leak
        sampler = Repeat(lambda: rss.append(tree_rss_bytes(pgid)), 0.5)
        sampler.start()
        rounds: list[list[dict]] = []  # the probes' mismatches, per round
        threads, outcomes = clients(port, workload, self.args.clients, self.args.seed, lm.server.alive)
        probe_every = max(2.0, self.seconds / 10)
        threads.append(Repeat(lambda: rounds.append(ask_probes(port, probes, reference)[1]), probe_every))
        chaos = None
        if kvlens:
            restart = self.restart_redis if self.redis is not None else None
            disk = kvlens_disk_dir(self.settings, lm.mode.name)
            chaos = Chaos(disk, self.seconds, seed=self.args.seed, restart_remote=restart)
            threads.append(chaos)
        began = time.monotonic()
        try:
            for t in threads:
                t.start()
            time.sleep(self.seconds)
        finally:
            for t in [*threads[-1:], *threads[:-1]] if chaos else threads:
                t.stop()  # chaos first: the folder is writable again before anything else
        failures = [o for o in outcomes if not o.ok]
        timeline = rss[:: max(1, len(rss) // 10)]
        rec |= {
            "soak_s": round(time.monotonic() - began, 1),
            "requests": len(outcomes),
            "hung_up": sum(o.hung_up for o in outcomes),
            "failures": len(failures),
            "failure_samples": sorted({o.error for o in failures})[:5],
            "p50_ms": latency_ms(outcomes, 50),
            "p99_ms": latency_ms(outcomes, 99),
            "rss_at_start_mb": round(rss[0] / 2**20),
            "rss_timeline_mb": [round(b / 2**20) for b in timeline if b],
            "rss_by_process_mb_at_start": rss_at_start,
            "cpu_budget_mb": cpu_budget_bytes() // 2**20 if kvlens else None,
            "faults": dict(chaos.faults) if chaos else {},
            "faults_injected": sum(chaos.faults.values()) if chaos else 0,
            "chaos_errors": chaos.errors if chaos else [],
            "server_alive": lm.server.alive(),
        }
        lm.client.reset_prefix_cache()  # the last probes are served by KVLens (or recomputed), not vLLM
        _, after = ask_probes(port, probes, reference)
        rec["probes_asked"] = len(probes) * (2 + len(rounds))
        rec["probe_mismatches"] = [m for r in rounds for m in r] + after
        rec["probe_mismatch_count"] = len(rec["probe_mismatches"])
        answered = [m for m in rec["probe_mismatches"] if "got" in m]
        rec["probe_verdicts"] = [verdict(port, probes[m["probe"]], m) for m in answered]
        rec["wrong_kv"] = sum(v["verdict"] == "wrong_kv" for v in rec["probe_verdicts"])
        if kvlens:
            rec["leak_gauges_after_drain"] = leaks_drained(lm.client)
            rec["leaks_after_drain"] = sum(v or 0 for v in rec["leak_gauges_after_drain"].values())
            rec["metrics"] = kvlens_metrics(lm.client)
            rec["failed_load_requests"] = rec["metrics"]["failed_load_requests"] or 0
        sampler.stop()
        rec["peak_rss_mb"] = round(max(rss) / 2**20)
        rec["rss_growth_mb"] = rec["peak_rss_mb"] - rec["rss_at_start_mb"]
        rec["rss_by_process_mb_at_end"] = {
            k: round(v / 2**20) for k, v in rss_by_process(lm.server.pid).items()
        }


if __name__ == "__main__":
    sys.exit(main(Soak))
