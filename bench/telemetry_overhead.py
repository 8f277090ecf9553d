"""What KVLens telemetry costs: the same workload with tracing + metrics on and off, in one run.

    .venv/bin/python bench/telemetry_overhead.py [--quick] [--model DIR] [--rounds 16]
                                                 [--compare telemetry|request_log|whatif]

The default model is the tiny test model, whose requests take only ~30 ms, so that the share
printed is a worst case; --model .run/bench/models/llama-h1024-l8 (built by the serving
benchmarks) gives a more realistic share.

One offline engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the connector's
telemetry can be switched between passes of the same engine; passes alternate on/off in ABBA
order (the runner's turns) so that drift cancels. "On" means everything an operator would
enable: spans exported over OTLP/HTTP to a collector in another process (BatchSpanProcessor),
KVLens stats built every step and recorded by vLLM's Prometheus logger. "Off" keeps vLLM's own
stats on and turns KVLens telemetry off. Each pass: every request looks up and loads a shared
1,024-token prefix from the CPU tier, computes and stores a new 256-token chunk, and decodes a
few tokens.

Each "on" pass ends by building and exporting its spans (inside the timed region), so that no
telemetry work spills into the next pass; with the usual 5-second batching the export would
overlap later work instead, so this is an upper bound.

``--compare request_log`` and ``--compare whatif`` measure one insight feature the same way
instead, with tracing and metrics on in both passes: the per-request log (every request
written, sample rate 1) and the what-if sizing curves (recording on the step loop plus the
feeder thread). Only the A/B figures are reported for those.

Reported: per-pass wall time on and off and their paired ratio, and, from separate accounting
passes (case "accounting"), the time spent inside KVLens telemetry per request: on the engine's
step loop (wall time, what delays requests) and on background threads (CPU time of span
building and OTLP export). The accounting is not lost in scheduling noise the way the A/B
ratio is on a small shared machine. Target: overhead below 1% of end-to-end time.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib import models  # noqa: E402
from bench.lib.offline import CallTimer, kvlens_llm  # noqa: E402
from bench.lib.runner import Benchmark, Case, Figure, Option, Side, Target, main  # noqa: E402

_SINK = textwrap.dedent("""
    import sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    class H(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()
        def log_message(self, *a):
            pass
    s = ThreadingHTTPServer(("127.0.0.1", 0), H)
    print(s.server_address[1], flush=True)
    s.serve_forever()
""")


def start_sink() -> tuple[subprocess.Popen, int]:
    """An OTLP/HTTP endpoint in another process that accepts and drops spans (a collector)."""
    proc = subprocess.Popen([sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


class TelemetryOverhead(Benchmark):
    name = "telemetry_overhead"
    figures = (
        Figure("pass_ms", "ms per pass", "{:.1f}", ratio=True),
        Figure("whatif_references", "what-if references", "{:.0f}", plot=False),
        Figure("end_to_end_ms_per_request", "ms per request", "{:.1f}", plot=False),
        Figure("step_loop_us_per_request", "step loop µs/request", "{:.0f}", panel="telemetry per request"),
        Figure(
            "background_us_per_request", "background CPU µs/request", "{:.0f}", panel="telemetry per request"
        ),
        Figure("step_loop_share", "step loop share", "{:.3%}", panel="share of end-to-end time"),
        Figure("total_share", "share in all", "{:.3%}", panel="share of end-to-end time"),
    )
    baselines = ("off",)
    targets = (Target("KVLens telemetry on the step loop <= 1% of end-to-end time", "step_loop_share", 0.01),)
    repeats = (16, 2)
    repeat_flags = ("--rounds",)
    options = {
        "model": Option(None, help="model directory (default: the tiny model, built once)"),
        "requests": Option(16, 4, "requests per pass"),
        "prefix": Option(1024, help="shared prefix tokens (loaded from KVLens)"),
        "suffix": Option(256, help="new tokens per request (computed and stored)"),
        "max_tokens": Option(32, 8, "generated tokens per request"),
        "compare": Option(
            "telemetry",
            help="what is switched on and off between passes",
            choices=("telemetry", "request_log", "whatif"),
        ),
    }

    def sides(self) -> list[Side]:
        return [Side("on", f"{self.args.compare} on"), Side("off", f"{self.args.compare} off")]

    def cases(self) -> list[Case]:
        accounting = [Case("accounting", repeats=max(self.args.repeats // 2, 3))]
        return [Case("A/B"), *(accounting if self.args.compare == "telemetry" else [])]

    def applies(self, side: Side, case: Case) -> bool:
        return case.name == "A/B" or side.name == "on"

    @contextlib.contextmanager
    def setup(self) -> Iterator[None]:
        sink, port = start_sink()
        try:
            self.start_engine(port)
            self.set_mode(True)
            self.one_pass(served=False)  # stores the prefixes
            yield
        finally:
            sink.terminate()
            sink.wait(timeout=10)

    def start_engine(self, sink_port: int) -> None:
        a = self.args
        self.model = a.model or str(models.ensure_model(models.TINY))
        os.environ.update(
            {
                "KVLENS_TRACING": "1",
                "KVLENS_METRICS": "1",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{sink_port}/v1/traces",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                "OTEL_BSP_SCHEDULE_DELAY": "1000",
            }
        )
        from vllm import SamplingParams
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        from telemetry.request_log import RequestLog

        max_len = a.prefix + a.suffix + a.max_tokens + 64
        extra = {"lmcache.chunk_size": 256, "lmcache.max_local_cpu_size": 2}
        self.llm = kvlens_llm(
            self.model, extra, dtype="bfloat16", seed=0, max_model_len=max_len, disable_log_stats=False
        )
        self.scheduler_connector = self.llm.llm_engine.engine_core.engine_core.scheduler.connector
        self.worker_connector = get_kv_transfer_group()
        self.insight = self.scheduler_connector._scheduler.insight  # records what-if references
        self.whatif = self.insight.whatif
        self.request_log = RequestLog(str(Path(tempfile.mkdtemp(prefix="kvlens-bench-")) / "requests.jsonl"))
        self.vocab = self.llm.llm_engine.model_config.get_vocab_size()
        self.rng = random.Random(0)
        self.prefixes = [
            [self.rng.randrange(10, self.vocab - 1) for _ in range(a.prefix)] for _ in range(a.requests)
        ]
        self.params = SamplingParams(
            temperature=0.0, max_tokens=a.max_tokens, detokenize=False, ignore_eos=True
        )

    def set_mode(self, on: bool) -> None:
        scheduler_tel = self.scheduler_connector._scheduler_telemetry
        if self.args.compare == "telemetry":
            scheduler_tel.configure(tracing=on, metrics=on)
            self.worker_connector._worker_telemetry.configure(tracing=on, metrics=on)
        elif self.args.compare == "request_log":
            scheduler_tel._requests = self.request_log if on else None
            scheduler_tel.configure(tracing=True, metrics=True)
        else:
            self.insight.whatif = self.whatif if on else None

    def one_pass(self, served: bool = True) -> float:
        """Seconds for one pass; with ``served``, its prefixes must have come from KVLens."""
        from vllm.inputs import TokensPrompt

        from telemetry import tracing

        a = self.args
        prompts = [
            TokensPrompt(
                prompt_token_ids=p + [self.rng.randrange(10, self.vocab - 1) for _ in range(a.suffix)]
            )
            for p in self.prefixes
        ]
        self.llm.reset_prefix_cache()  # so that the prefix comes from KVLens, not vLLM's own cache
        t = time.perf_counter()
        outs = self.llm.generate(prompts, self.params, use_tqdm=False)
        # The pass owns its telemetry: spans still queued or buffered are built and exported
        # before the clock stops, so that no work spills into the next (maybe "off") pass.
        tracing.flush()
        elapsed = time.perf_counter() - t
        cached = sum(o.num_cached_tokens for o in outs)
        assert not served or cached >= a.requests * (a.prefix - 256), (
            f"prefixes not served by KVLens: {cached}"
        )
        return elapsed

    def warm_up(self, side: Side) -> None:
        self.set_mode(side.name == "on")
        self.one_pass(served=False)
        self.one_pass(served=False)

    def start_case(self, case: Case, sides: list[Side]) -> None:
        if case.name == "accounting":
            self.set_mode(True)
            self.step_loop, self.background = accounting(
                self.llm, self.scheduler_connector, self.worker_connector
            )

    def measure(self, side: Side, case: Case, rep: int) -> dict[str, float]:
        if case.name == "A/B":
            self.set_mode(side.name == "on")
            refs = self.whatif.processed + self.whatif.pending if self.whatif else 0
            rec = {"pass_ms": self.one_pass() * 1e3}
            if self.args.compare == "whatif":  # what the feature did in this pass
                rec["whatif_references"] = self.whatif.processed + self.whatif.pending - refs
            return rec
        step, background, n = self.step_loop.seconds, self.background.seconds, self.args.requests
        wall = self.one_pass()
        step, background = self.step_loop.seconds - step, self.background.seconds - background
        return {
            "pass_ms": wall * 1e3,
            "end_to_end_ms_per_request": wall / n * 1e3,
            "step_loop_us_per_request": step / n * 1e6,
            "background_us_per_request": background / n * 1e6,
            "step_loop_share": step / wall,
            "total_share": (step + background) / wall,
        }

    def end_case(self, case: Case) -> None:
        if case.name != "accounting":
            return
        self.step_loop.unwrap()
        self.background.unwrap()
        requests = case.repeats * self.args.requests
        self.breakdown = {
            label: {
                name: s / requests * 1e6 for name, s in sorted(part.by_name.items(), key=lambda kv: -kv[1])
            }
            for label, part in (("step_loop_wall", self.step_loop), ("background_cpu", self.background))
        }
        for label, by_name in self.breakdown.items():
            print(f"   {label}, µs per request: " + ", ".join(f"{n} {us:.1f}" for n, us in by_name.items()))

    def workload(self) -> dict[str, Any]:
        a = self.args
        sizes = {"requests_per_pass": a.requests, "prefix_tokens": a.prefix, "suffix_tokens": a.suffix}
        return {"model": self.model, **sizes, "max_tokens": a.max_tokens, **getattr(self, "breakdown", {})}


def accounting(llm: Any, scheduler_connector: Any, worker_connector: Any) -> tuple[CallTimer, CallTimer]:
    """Time inside KVLens telemetry from now on: on the step loop (wall) and on background
    threads (CPU time of span building and OTLP export)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    from telemetry import scheduler_recorder, tracing

    hooks = ("lookup", "lookup_final", "loads_reported", "finished", "requests_done", "on_worker_stats")
    acct = CallTimer().wrap(scheduler_connector._scheduler_telemetry, *hooks)
    acct.wrap(scheduler_recorder._LookupTimer, "__enter__", "__exit__")  # around each lookup
    acct.wrap(worker_connector._worker_telemetry, "now", "loaded", "saved", "finished")
    # Stats: built by both halves (the recorders' ``stats``), then handled by vLLM's loggers here.
    acct.wrap(scheduler_connector, "get_kv_connector_stats")
    acct.wrap(worker_connector, "get_kv_connector_stats")
    for stat_logger in getattr(llm.llm_engine.logger_manager, "stat_loggers", []):
        prom = getattr(getattr(stat_logger, "kv_connector_prom", None), "prom_metrics", None)
        if prom is not None:
            acct.wrap(prom, "observe")
        for sub_logger in getattr(stat_logger, "per_engine_stat_loggers", {}).values():
            for one in sub_logger if isinstance(sub_logger, list) else [sub_logger]:
                logging_ = getattr(one, "kv_connector_logging", None)
                if logging_ is not None:
                    acct.wrap(logging_, "observe")
    background = CallTimer(clock=time.thread_time).wrap(tracing, "_build").wrap(OTLPSpanExporter, "export")
    tracing.flush()
    return acct, background


if __name__ == "__main__":
    code = main(TelemetryOverhead)
    sys.stdout.flush()
    os._exit(code)  # skip vLLM's slow teardown
