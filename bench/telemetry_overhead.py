"""What KVLens telemetry costs: the same workload with tracing + metrics on and off, in one run.

    source scripts/env.sh && .venv/bin/python bench/telemetry_overhead.py [--model DIR] [--rounds 16]

The default model is the tiny test model, whose requests take only ~30 ms, so that the share
printed is a worst case; a larger model gives a more realistic share, e.g.
`python scripts/tiny_model.py /tmp/bench-model --layers 8 --hidden 1024 --heads 16 --kv-heads 8`.

One offline engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the connector's
telemetry can be switched between passes of the same engine; passes alternate on/off in ABBA
order so that drift cancels. "On" means everything an operator would enable: spans exported
over OTLP/HTTP to a collector in another process (BatchSpanProcessor), KVLens stats built every
step and recorded by vLLM's Prometheus logger. "Off" keeps vLLM's own stats on and turns
KVLens telemetry off. Each pass: every request looks up and loads a shared 1,024-token prefix
from the CPU tier, computes and stores a new 256-token chunk, and decodes a few tokens.

Each "on" pass ends by building and exporting its spans (inside the timed region), so that no
telemetry work spills into the next pass; with the usual 5-second batching the export would
overlap later work instead, so this is an upper bound.

``--compare request_log`` and ``--compare whatif`` measure one insight feature the same way
instead, with tracing and metrics on in both passes: the per-request log (every request
written, sample rate 1) and the what-if sizing curves (recording on the step loop plus the
feeder thread). Only the A/B figures are reported for those.

Reported: median per-pass wall time on and off, the median of the paired on/off ratios, and,
from separate accounting passes, the time spent inside KVLens telemetry per request: on the
engine's step loop (wall time, what delays requests) and on background threads (CPU time of
span building and OTLP export). The accounting is not lost in scheduling noise the way the A/B
ratio is on a small shared machine. Target: overhead below 1% of end-to-end time.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

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


class Accounting:
    """Time spent inside the given functions (for the accounting passes only).

    ``clock`` is wall time for code on the step loop (waiting there delays the engine) and the
    thread's CPU time for background threads (their waits on I/O or the GIL cost nothing).
    """

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.seconds = 0.0
        self.by_name: dict[str, float] = {}
        self._patched: list[tuple[object, str, object, bool]] = []

    def wrap(self, obj: object, names: list[str]) -> None:
        for name in names:
            own = name in vars(obj)  # a module's or class's own attribute, else a method via the class
            original = vars(obj)[name] if own else getattr(obj, name)
            target = getattr(obj, name)
            label = getattr(target, "__qualname__", name)

            @functools.wraps(target)
            def timed(*args, __target=target, __label=label, **kwargs):
                t = self.clock()
                try:
                    return __target(*args, **kwargs)
                finally:
                    dt = self.clock() - t
                    self.seconds += dt
                    self.by_name[__label] = self.by_name.get(__label, 0.0) + dt

            setattr(obj, name, timed)
            self._patched.append((obj, name, original, own))

    def unwrap(self) -> None:
        for obj, name, original, own in reversed(self._patched):
            if own:
                setattr(obj, name, original)
            else:
                delattr(obj, name)
        self._patched.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / ".run" / "tiny-model"))
    ap.add_argument("--rounds", type=int, default=16, help="ABBA rounds (each: one on and one off pass)")
    ap.add_argument("--requests", type=int, default=16, help="requests per pass")
    ap.add_argument("--prefix", type=int, default=1024, help="shared prefix tokens (loaded from KVLens)")
    ap.add_argument("--suffix", type=int, default=256, help="new tokens per request (computed and stored)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument(
        "--compare",
        choices=("telemetry", "request_log", "whatif"),
        default="telemetry",
        help="what is switched on and off between passes",
    )
    args = ap.parse_args()

    sink, port = start_sink()
    try:
        run(args, port)
    finally:
        sink.terminate()
        sink.wait(timeout=10)
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow teardown


def run(args: argparse.Namespace, sink_port: int) -> None:
    if not Path(args.model, "config.json").exists():
        out = Path(tempfile.mkdtemp(prefix="kvlens-bench-model-"))
        builder = REPO / "scripts" / "tiny_model.py"
        subprocess.run([sys.executable, str(builder), str(out)], cwd=REPO, check=True)
        args.model = str(out)
    os.environ.update(
        {
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "KVLENS_TRACING": "1",
            "KVLENS_METRICS": "1",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{sink_port}/v1/traces",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            "OTEL_BSP_SCHEDULE_DELAY": "1000",
        }
    )
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    from telemetry import tracing

    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        seed=0,
        max_model_len=args.prefix + args.suffix + args.max_tokens + 64,
        disable_log_stats=False,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVLensConnector",
            kv_connector_module_path="connector",
            kv_role="kv_both",
            kv_connector_extra_config={"lmcache.chunk_size": 256, "lmcache.max_local_cpu_size": 2},
        ),
    )
    scheduler_connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    worker_connector = get_kv_transfer_group()
    scheduler_tel = scheduler_connector._scheduler_telemetry
    worker_tel = worker_connector._worker_telemetry
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(0)
    prefixes = [[rng.randrange(10, vocab - 1) for _ in range(args.prefix)] for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=False, ignore_eos=True)

    sched = scheduler_connector._scheduler
    whatif = sched.whatif
    from telemetry.request_log import RequestLog

    request_log = RequestLog(str(Path(tempfile.mkdtemp(prefix="kvlens-bench-")) / "requests.jsonl"))

    def set_mode(on: bool) -> None:
        if args.compare == "telemetry":
            scheduler_tel.configure(tracing=on, metrics=on)
            worker_tel.configure(tracing=on, metrics=on)
        elif args.compare == "request_log":
            scheduler_tel._requests = request_log if on else None
            scheduler_tel.configure(tracing=True, metrics=True)
        else:
            sched.whatif = whatif if on else None

    def one_pass() -> tuple[float, int]:
        prompts = [
            TokensPrompt(prompt_token_ids=p + [rng.randrange(10, vocab - 1) for _ in range(args.suffix)])
            for p in prefixes
        ]
        llm.reset_prefix_cache()  # so that the prefix comes from KVLens, not vLLM's own cache
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        # The pass owns its telemetry: spans still queued or buffered are built and exported
        # before the clock stops, so that no work spills into the next (maybe "off") pass.
        tracing.flush()
        elapsed = time.perf_counter() - t
        return elapsed, sum(o.num_cached_tokens for o in outs)

    set_mode(True)
    one_pass()  # stores the prefixes
    for on in (True, False, True, False):  # warm-up
        set_mode(on)
        one_pass()

    on_times, off_times, ratios = [], [], []
    for r in range(args.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        times = {}
        for on in order:
            set_mode(on)
            times[on], cached = one_pass()
            assert cached >= args.requests * (args.prefix - 256), f"prefixes not served by KVLens: {cached}"
        on_times.append(times[True])
        off_times.append(times[False])
        ratios.append(times[True] / times[False])
        print(
            f"round {r:2d}: on {times[True] * 1000:7.1f} ms  off {times[False] * 1000:7.1f} ms  "
            f"ratio {ratios[-1]:.4f}",
            flush=True,
        )

    if args.compare != "telemetry":
        report_ab(args, on_times, off_times, ratios)
        return

    # Accounting passes: time inside KVLens telemetry itself, with everything on.
    set_mode(True)
    acct = Accounting()
    acct.wrap(
        scheduler_tel,
        [
            "lookup",
            "after_alloc",
            "on_plan",
            "on_worker_report",
            "finished",
            "on_worker_stats",
            "_lookup_done",
        ],
    )
    acct.wrap(worker_tel, ["now", "loaded", "saved", "finished"])
    # Stats: built by both halves, then handled by vLLM's loggers in this process.
    acct.wrap(scheduler_connector, ["get_kv_connector_stats"])
    acct.wrap(worker_connector, ["get_kv_connector_stats"])
    for stat_logger in getattr(llm.llm_engine.logger_manager, "stat_loggers", []):
        prom = getattr(getattr(stat_logger, "kv_connector_prom", None), "prom_metrics", None)
        if prom is not None:
            acct.wrap(prom, ["observe"])
        for sub_logger in getattr(stat_logger, "per_engine_stat_loggers", {}).values():
            for one in sub_logger if isinstance(sub_logger, list) else [sub_logger]:
                logging_ = getattr(one, "kv_connector_logging", None)
                if logging_ is not None:
                    acct.wrap(logging_, ["observe"])
    # Off the step loop: building spans (KVLens's builder thread) and exporting them (the SDK's).
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    background = Accounting(clock=time.thread_time)
    background.wrap(tracing, ["_build"])
    background.wrap(OTLPSpanExporter, ["export"])
    tracing.flush()
    acct_wall = 0.0
    acct_passes = max(args.rounds // 2, 3)
    for _ in range(acct_passes):
        acct_wall += one_pass()[0]
    tracing.flush()
    acct.unwrap()
    background.unwrap()
    requests = acct_passes * args.requests
    parts = (("on the step loop (wall time)", acct), ("background threads (CPU time)", background))
    for label, part in parts:
        print(label)
        for name, seconds in sorted(part.by_name.items(), key=lambda kv: -kv[1]):
            print(f"  {name:40s} {seconds / requests * 1e6:8.1f} us per request")
    per_request_us = acct.seconds / requests * 1e6
    share = acct.seconds / acct_wall
    background_us = background.seconds / requests * 1e6

    med_on, med_off = statistics.median(on_times), statistics.median(off_times)
    paired = statistics.median(ratios)
    result = {
        "rounds": args.rounds,
        "requests_per_pass": args.requests,
        "prefix_tokens": args.prefix,
        "suffix_tokens": args.suffix,
        "max_tokens": args.max_tokens,
        "median_pass_on_s": med_on,
        "median_pass_off_s": med_off,
        "ratio_of_medians": med_on / med_off,
        "median_paired_ratio": paired,
        "paired_ratio_min": min(ratios),
        "paired_ratio_max": max(ratios),
        "telemetry_us_per_request": per_request_us,
        "telemetry_share_of_wall": share,
        "background_us_per_request": background_us,
        "total_share_of_wall": (acct.seconds + background.seconds) / acct_wall,
        "end_to_end_ms_per_request": acct_wall / requests * 1000,
    }
    print()
    print(
        f"end-to-end per pass ({args.requests} requests): on {med_on * 1000:.1f} ms, "
        f"off {med_off * 1000:.1f} ms (medians of {args.rounds})"
    )
    print(
        f"on/off: median paired ratio {paired:.4f} ({(paired - 1) * 100:+.2f}%), "
        f"range {min(ratios):.4f}..{max(ratios):.4f}; ratio of medians {med_on / med_off:.4f}"
    )
    print(
        f"time inside KVLens telemetry on the engine's step loop: {per_request_us:.0f} us per request = "
        f"{share * 100:.3f}% of end-to-end time ({result['end_to_end_ms_per_request']:.1f} ms per request)"
    )
    print(
        f"off the step loop (span building and OTLP export threads): {background_us:.0f} us per request; "
        f"all telemetry together = {result['total_share_of_wall'] * 100:.3f}% of end-to-end time"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def report_ab(
    args: argparse.Namespace, on_times: list[float], off_times: list[float], ratios: list[float]
) -> None:
    med_on, med_off, paired = (
        statistics.median(on_times),
        statistics.median(off_times),
        statistics.median(ratios),
    )
    print(
        f"\n{args.compare} on/off: median paired ratio {paired:.4f} ({(paired - 1) * 100:+.2f}%), "
        f"range {min(ratios):.4f}..{max(ratios):.4f}; "
        f"per pass on {med_on * 1000:.1f} ms, off {med_off * 1000:.1f} ms"
    )
    if args.json:
        result = {"compare": args.compare, "median_paired_ratio": paired, "paired_ratio_min": min(ratios)}
        result |= {"paired_ratio_max": max(ratios), "median_pass_on_s": med_on, "median_pass_off_s": med_off}
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
