"""Prefill/decode disaggregation against one and two instances, on the same cores, under load.

    python bench/pd_serve.py [--quick] [--modes single,rr2,1p1d] [--request-rate 0.3]

``vllm bench serve`` (run in this process, ``bench/lib/bench_serve.py``) sends a prefill-heavy
random workload (--input-len prompt tokens, --output-len generated, --num-prompts at
--request-rate) to each mode in turn:

- ``single``: one vLLM instance whose worker has both cores;
- ``rr2``: two instances, one core each, behind ``kvlens pd-proxy --no-pd`` (plain round-robin);
- ``1p1d``: a prefiller (KVLens, ``kv_producer``, PD sender) on one core and a decoder (KVLens,
  ``kv_consumer``, PD receiver) on the other, behind ``kvlens pd-proxy``: the prefiller computes
  each prompt and sends its KV to the decoder over TCP, the decoder generates the rest.

Each engine's worker is pinned to its own core (``VLLM_CPU_OMP_THREADS_BIND``); the API servers
and engine cores are not. Reported per mode: TTFT and inter-token latency p50/p99, output and
request throughput, each as a ratio to ``single``; for 1p1d also the proxy's transfer wait, the
notifications that did not come in time, and the prompt tokens the decoder loaded rather than
computed (vLLM's ``prompt_tokens_by_source``). PD's promise is decode free of prefill stalls:
its inter-token latency p99 against the others says whether it holds here.

A client sees the first token when the prefiller answers (the proxy sends it at once); the
second comes after the transfer and the decoder's first step, so PD's TTFT is the prefill alone
and its transfer shows in ITL. Prints the tables; writes .run/bench/results/pd_serve.json.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib.bench_serve import BenchServeFailed, run_bench_serve  # noqa: E402
from bench.lib.client import metric_sum  # noqa: E402
from bench.lib.models import BENCH, REAL_HELP, TINY, check_fits, ensure_model, real_model  # noqa: E402
from bench.lib.paths import RUN_DIR  # noqa: E402
from bench.lib.ports import free_ports  # noqa: E402
from bench.lib.report import Figure, Target  # noqa: E402
from bench.lib.runner import Benchmark, Option, SideFailed, main  # noqa: E402
from bench.lib.servers import (  # noqa: E402
    SERVED_MODEL_NAME,
    WORKER_IN_CORE_HELP,
    ManagedProcess,
    VllmServer,
    server_env,
)

LATENCY_KEY = re.compile(r"^(mean|median|p\d+)_(ttft|tpot|itl|e2el)_ms$")
RESULT_KEYS = ("duration", "completed", "failed", "request_throughput", "output_throughput")
SOURCES_METRIC = "vllm:prompt_tokens_by_source_total"
PANEL_LAT = "latency (ms)"
FIGURES = (
    Figure("p50_ttft_ms", "TTFT p50 ms", "{:.0f}", ratio=True, log=True, panel=PANEL_LAT),
    Figure("p99_ttft_ms", "TTFT p99 ms", "{:.0f}", ratio=True, log=True, panel=PANEL_LAT),
    Figure("p50_itl_ms", "ITL p50 ms", "{:.1f}", ratio=True, log=True, panel=PANEL_LAT),
    Figure("p99_itl_ms", "ITL p99 ms", "{:.1f}", ratio=True, log=True, panel=PANEL_LAT),
    Figure("output_throughput", "output tok/s", "{:.1f}", ratio=True),
    Figure("request_throughput", "req/s", "{:.3f}", ratio=True, plot=False),
    Figure("failed", "failed", "{:.0f}", plot=False),
    Figure("pd_transfer_wait_ms", "PD transfer wait ms (mean)", "{:.1f}", plot=False),
    Figure("pd_wait_timeouts", "PD notifications late", "{:.0f}", plot=False),
    Figure("decoder_loaded_tokens", "decoder prompt tokens loaded", "{:.0f}", plot=False),
)


def pd_kv_transfer_configs(
    proxy_port: int, init_port: int, alloc_port: int, buffer_bytes: int = 1 << 30
) -> tuple[dict, dict]:
    """The prefiller's and the decoder's --kv-transfer-config, with the keys of LMCache's 1p1d
    example (``transfer_channel: tcp`` instead of nixl)."""

    def config(role: str, extra: dict[str, Any]) -> dict[str, Any]:
        common = {"enable_pd": True, "transfer_channel": "tcp", "local_cpu": False}
        common |= {"pd_buffer_size": buffer_bytes, "pd_buffer_device": "cpu"}
        return {
            "kv_connector": "KVLensConnector",
            "kv_connector_module_path": "connector",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {f"lmcache.{k}": v for k, v in (common | extra).items()},
        }

    sender = {"pd_role": "sender", "pd_proxy_host": "127.0.0.1", "pd_proxy_port": proxy_port}
    receiver = {"pd_role": "receiver", "pd_peer_host": "127.0.0.1"}
    receiver |= {"pd_peer_init_port": [init_port], "pd_peer_alloc_port": [alloc_port]}
    return config("kv_producer", sender), config("kv_consumer", receiver)


class ProxyProcess(ManagedProcess):
    """``kvlens pd-proxy`` (``--no-pd``: plain round-robin) in its own process group."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "connector.ops.cli", "pd-proxy", "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port), *args]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        env = {k: v for k, v in env.items() if not k.startswith("OTEL_")}
        super().__init__(cmd, env, log_path)
        self.name = "kvlens pd-proxy"

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def get(self, path: str) -> str:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(self.url + path, timeout=30) as r:
            return r.read().decode()


@dataclass
class Deployment:
    """One mode: its engines (role -> server), the proxy in front (if any), where clients go."""

    name: str
    engines: dict[str, VllmServer] = field(default_factory=dict)
    proxy: ProxyProcess | None = None

    @property
    def url(self) -> str:
        return self.proxy.url if self.proxy else next(iter(self.engines.values())).url

    def processes(self) -> list[ManagedProcess]:
        return [*self.engines.values(), *([self.proxy] if self.proxy else [])]


@dataclass(frozen=True, slots=True)
class ModeSide:
    name: str
    label: str


class PDServe(Benchmark):
    name = "pd_serve"
    title = "vllm bench serve, prefill-heavy: 1P1D behind kvlens pd-proxy vs one and two instances"
    figures = FIGURES
    baselines = ("single",)
    targets = (
        Target(
            "1P1D inter-token latency p99 <= single's",
            "p99_itl_ms",
            1.0,
            baseline="single",
            mode_prefix="1p1d",
        ),
    )
    legend = (
        "Ratios to `single` per repetition (latency: lower is better; throughput: higher). PD's TTFT is "
        "the prefill alone (the proxy streams the prefiller's token at once); its transfer and the "
        "decoder's first step show in ITL.",
        "`single` runs two OpenMP threads; on a machine busy with other work their barriers wait for "
        "each other (a --quick run here measured it 8x slower than `rr2`): compare with `single1` "
        "(--modes single,single1,rr2,1p1d) before reading PD's ratios.",
    )
    default_modes = "single,rr2,1p1d"
    quick_modes = default_modes
    repeats = (3, 1)
    seed = 7
    progress_each_turn = True
    failures = (SideFailed, OSError, TimeoutError, RuntimeError)
    options = {
        "input_len": Option(2000, 600, help="prompt tokens (random)"),
        "output_len": Option(128, 16, help="generated tokens"),
        "num_prompts": Option(20, 6, help="requests per run"),
        "request_rate": Option(0.3, "inf", help="requests per second (Poisson; inf: all at once)", type=str),
        "max_concurrency": Option(None, 2, help="requests in flight at most", type=int),
        "notify_timeout": Option(5.0, help="kvlens pd-proxy --notify-timeout"),
        "pd_buffer_mb": Option(1024, 256, help="pd_buffer_size of the prefiller and the decoder, MiB"),
        "model": Option(None, help="model directory (default: built under .run/bench/models)", type=Path),
        "real": Option(False, help=REAL_HELP),
        "worker_in_core": Option(False, help=WORKER_IN_CORE_HELP),
        "startup_timeout": Option(600.0, help="seconds for the servers of one mode to start"),
        "run_timeout": Option(1800.0, 600.0, help="seconds for one vllm bench serve run"),
    }

    def __init__(self, args: Any) -> None:
        super().__init__(args)
        if args.real and args.model:
            raise SystemExit("--real and --model name two models: give one")
        self.spec = None if args.real else TINY if self.quick else BENCH
        self.model = real_model() if args.real else Path(args.model or ensure_model(self.spec))
        check_fits(self.model, self.max_model_len)
        self.work_dir = RUN_DIR / "runs" / f"{self.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        allowed = sorted(os.sched_getaffinity(0))
        self.cores = (allowed[0], allowed[1] if len(allowed) > 1 else allowed[0])
        if len(allowed) < 2:
            self.note("one core only: every engine shares it")

    @property
    def result_name(self) -> str:
        return f"{self.name}-real" if self.args.real else self.name

    @property
    def max_model_len(self) -> int:
        return self.args.input_len + self.args.output_len + 64

    def sides(self) -> list[ModeSide]:
        return [
            ModeSide("single", "one instance, both cores"),
            ModeSide("single1", "one instance, one core (not by default)"),
            ModeSide("rr2", "two instances, a core each, round-robin"),
            ModeSide("1p1d", "prefiller + decoder, a core each, kvlens pd-proxy"),
        ]

    def describe(self, side: Any) -> dict[str, Any]:
        return {"label": side.label}

    # ---- servers: one mode at a time (each mode uses both cores) ----------------------------------
    def open_sides(self):
        for side in self.modes:
            deployment = self._start(side.name)
            try:
                self._wait_ready(deployment)
            except (RuntimeError, TimeoutError) as e:
                self._stop(deployment)
                self.skip(side, f"did not start ({str(e).splitlines()[0]})")
                continue
            self.deployments = {side.name: deployment}
            try:
                yield [side]
            finally:
                self._stop(deployment)

    def close_side(self, side: Any) -> None:
        deployment = getattr(self, "deployments", {}).pop(side.name, None)
        if deployment is not None:
            self._stop(deployment)

    def _engine(self, name: str, cores: str, ktc: dict[str, Any] | None) -> VllmServer:
        env = server_env(1, {"VLLM_CPU_OMP_THREADS_BIND": cores, "PYTHONHASHSEED": "0"})
        log = self.work_dir / f"{name}.log"
        return VllmServer(
            name,
            sys.executable,
            self.model,
            self.max_model_len,
            ktc,
            [],
            env,
            log,
            worker_in_core=self.args.worker_in_core,
        )

    def _start(self, mode: str) -> Deployment:
        a, (c0, c1) = self.args, self.cores
        d = Deployment(mode)
        if mode == "single":
            d.engines["single"] = self._engine("single", f"{c0},{c1}" if c0 != c1 else str(c0), None)
        elif mode == "single1":
            d.engines["single1"] = self._engine("single1", str(c0), None)
        elif mode == "rr2":
            d.engines["rr-a"] = self._engine("rr-a", str(c0), None)
            d.engines["rr-b"] = self._engine("rr-b", str(c1), None)
            ports = ",".join(str(e.port) for e in d.engines.values())
            d.proxy = ProxyProcess(
                ["--no-pd", "--decoder-host", "127.0.0.1", "--decoder-port", ports],
                self.work_dir / "rr2-proxy.log",
            )
        else:
            zport, init, alloc = free_ports(3)
            sender, receiver = pd_kv_transfer_configs(zport, init, alloc, a.pd_buffer_mb << 20)
            d.engines["prefiller"] = self._engine("prefiller", str(c0), sender)
            d.engines["decoder"] = self._engine("decoder", str(c1), receiver)
            args = ["--prefiller-host", "127.0.0.1", "--prefiller-port", str(d.engines["prefiller"].port)]
            args += ["--decoder-host", "127.0.0.1", "--decoder-port", str(d.engines["decoder"].port)]
            args += ["--decoder-init-port", str(init), "--decoder-alloc-port", str(alloc)]
            args += ["--proxy-host", "127.0.0.1", "--proxy-port", str(zport)]
            args += [
                "--notify-timeout",
                str(a.notify_timeout),
                "--request-log",
                str(self.work_dir / "pd-requests.jsonl"),
            ]
            d.proxy = ProxyProcess(args, self.work_dir / "1p1d-proxy.log")
        for p in d.processes():
            p.start()
        return d

    def _wait_ready(self, d: Deployment) -> None:
        deadline = time.monotonic() + self.args.startup_timeout
        for p in d.processes():
            p.wait_until(p.ready, deadline)
        print(f"   {d.name}: ready ({', '.join(d.engines)})", flush=True)

    @staticmethod
    def _stop(d: Deployment) -> None:
        for p in reversed(d.processes()):
            p.stop()

    # ---- one run ------------------------------------------------------------------------------
    def bench_serve_args(self, url: str, mode: str, rep: int, out: Path) -> list[str]:
        a = self.args
        argv = [
            *("--backend", "openai", "--endpoint", "/v1/completions", "--base-url", url),
            *("--model", SERVED_MODEL_NAME, "--tokenizer", str(self.model)),
            *("--dataset-name", "random", "--seed", str(a.seed + rep)),
            *("--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len)),
            *("--random-range-ratio", "0", "--num-prompts", str(a.num_prompts)),
            *("--request-rate", str(a.request_rate), "--ignore-eos", "--temperature", "0"),
            *("--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"),
            *("--metadata", f"mode={mode}", f"repetition={rep + 1}"),
            *(
                "--disable-tqdm",
                "--save-result",
                "--result-dir",
                str(out.parent),
                "--result-filename",
                out.name,
            ),
        ]
        if a.max_concurrency:
            argv += ["--max-concurrency", str(a.max_concurrency)]
        return argv

    def measure(self, side: ModeSide, case: Any, rep: int) -> dict[str, Any]:
        d = self.deployments[side.name]
        for engine in d.engines.values():
            _post(engine.url + "/reset_prefix_cache")
        before = self._pd_counters(d)
        out = self.work_dir / "vllm-bench" / f"{side.name}-rep{rep + 1}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            run_bench_serve(
                self.bench_serve_args(d.url, side.name, rep, out),
                out.with_suffix(".log"),
                self.args.run_timeout,
            )
        except BenchServeFailed as e:
            raise SideFailed(str(e)) from None
        if not out.exists():
            raise SideFailed(f"vllm bench serve wrote no result: {out.with_suffix('.log')}")
        rec = result_record(json.loads(out.read_text()))
        after = self._pd_counters(d)
        if d.name == "1p1d":
            rec |= pd_figures(before, after)
            if not rec["decoder_loaded_tokens"]:
                self.note(f"repetition {rep + 1}: the 1P1D decoder loaded no prompt token (it recomputed)")
        return rec

    def warm_up(self, side: ModeSide) -> None:
        """One short request through the mode's front door before it is measured."""
        prompt = [100 + i % 1500 for i in range(min(self.args.input_len, 300))]
        body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        _post(self.deployments[side.name].url + "/v1/completions", json.dumps(body).encode())

    def _pd_counters(self, d: Deployment) -> dict[str, float]:
        if d.name != "1p1d" or d.proxy is None:
            return {}
        return pd_counters(d.proxy.get("/metrics"), d.engines["decoder"].url)

    def alive(self, side: ModeSide) -> bool:
        d = self.deployments.get(side.name)
        return d is not None and all(p.ready() for p in d.processes())

    def workload(self) -> dict[str, Any]:
        shown = self.bench_serve_args("http://127.0.0.1:PORT", "MODE", 0, Path("RESULT_DIR/MODE-rep1.json"))
        return {"vllm_bench_serve": ["vllm", "bench", "serve", *shown], "cores": list(self.cores)}

    def meta(self) -> dict[str, Any]:
        return {
            **super().meta(),
            "model": {"path": str(self.model), "spec": "real" if self.args.real else repr(self.spec)},
            "work_dir": str(self.work_dir),
        }


def _post(url: str, body: bytes = b"") -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    with opener.open(request, timeout=300):
        pass


def result_record(result: dict[str, Any]) -> dict[str, Any]:
    """The figures of one ``vllm bench serve`` result file (latencies NaN when none completed)."""
    rec = {k: float(result.get(k, math.nan)) for k in RESULT_KEYS}
    for key, value in result.items():
        if LATENCY_KEY.match(key):
            rec[key] = float(value) if rec["completed"] else math.nan
    return rec


def pd_counters(proxy_metrics: str, decoder_url: str) -> dict[str, float]:
    """The proxy's transfer-wait sum and count and late notifications, the decoder's prompt tokens
    by source, so far."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(decoder_url + "/metrics", timeout=30) as r:
        decoder = r.read().decode()
    wait = "kvlens_pd_proxy_phase_seconds"
    return {
        "wait_sum": metric_sum(proxy_metrics, f"{wait}_sum", phase="transfer_wait"),
        "wait_count": metric_sum(proxy_metrics, f"{wait}_count", phase="transfer_wait"),
        "timeouts": metric_sum(proxy_metrics, "kvlens_pd_proxy_wait_timeouts_total"),
        "loaded": metric_sum(decoder, SOURCES_METRIC, source="external_kv_transfer"),
        "computed": metric_sum(decoder, SOURCES_METRIC, source="local_compute"),
    }


def pd_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    waits = delta["wait_count"]
    return {
        "pd_transfer_wait_ms": 1e3 * delta["wait_sum"] / waits if waits else math.nan,
        "pd_wait_timeouts": delta["timeouts"],
        "decoder_loaded_tokens": delta["loaded"],
        "decoder_computed_tokens": delta["computed"],
    }


if __name__ == "__main__":
    sys.exit(main(PDServe))
