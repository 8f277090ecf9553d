"""Serving throughput with many shared prefixes that do not fit vLLM's KV memory, per connector.

    python bench/prefix_repetition.py [--quick] [--modes none,ceiling,kvlens,example,lmcache]

The workload is vLLM's own serving benchmark, ``vllm bench serve --dataset-name
prefix_repetition``, run in this process (``bench/lib/bench_serve.py``) once per mode and
repetition: --prefixes random prefixes of --prefix-len tokens, each followed by
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

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib import workload as wl  # noqa: E402
from bench.lib.bench_serve import BenchServeFailed, run_bench_serve  # noqa: E402
from bench.lib.runner import Option, SideFailed, Target, main  # noqa: E402
from bench.lib.served import LiveMode  # noqa: E402
from bench.lib.servers import SERVED_MODEL_NAME  # noqa: E402

THROUGHPUT_TARGET = 0.98
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
SLACK_TOKENS = 64  # re-tokenisation may add a few tokens to a prompt


class PrefixRepetition(wl.ThroughputBenchmark):
    name = "prefix_repetition"
    title = "vllm bench serve, prefix_repetition: many shared prefixes, small vLLM KV memory"
    figures = (wl.OUTPUT_TPUT, wl.TOTAL_TPUT, wl.REQUEST_TPUT, wl.ttft(50), wl.ttft(99), *wl.COUNTS)
    baselines = ("ceiling", "none")
    targets = (
        Target(
            f"KVLens throughput >= {THROUGHPUT_TARGET} x ceiling",
            "total_token_throughput",
            THROUGHPUT_TARGET,
            at_most=False,
            baseline="ceiling",
            mode_prefix="kvlens",
        ),
    )
    legend = (
        "Throughput ratios are the same for output, total and request throughput (every mode serves the "
        "same tokens); TTFT: lower is better.",
    )
    default_modes = "none,ceiling,kvlens,example,lmcache"
    quick_modes = default_modes
    seed = 11
    repeats = (3, 2)  # the same sizes otherwise: the tiny model is ~10x faster
    options = {
        "prefixes": Option(8, help="distinct prefixes"),
        "prefix_len": Option(528, help="tokens per prefix: two KVLens chunks + 16"),
        "suffix_len": Option(48, help="tokens per suffix"),
        "output_len": Option(8, help="generated tokens per request"),
        "prompts_per_prefix": Option(3, help="requests per prefix"),
        "concurrency": Option(2, help="requests in flight: --max-concurrency"),
        "kv_blocks": Option(
            None, help="vLLM KV blocks in every mode but the ceiling (default: in-flight + 1)", type=int
        ),
        "run_timeout": Option(900.0, help="seconds for one vllm bench serve run"),
    }

    def sizes(self) -> tuple[int, int, int]:
        a = self.args
        max_len = a.prefix_len + a.suffix_len + a.output_len + SLACK_TOKENS
        return max_len, wl.blocks(max_len) * a.concurrency + 1, a.prefixes * (a.prefix_len + a.suffix_len)

    def bench_serve_args(self, url: str, mode: str, rep: int, out: Path) -> list[str]:
        """The arguments of ``vllm bench serve`` for one run (the JSON shows them too)."""
        a = self.args
        return [
            *("--backend", "openai", "--endpoint", "/v1/completions", "--base-url", url),
            *("--model", SERVED_MODEL_NAME, "--tokenizer", str(self.model)),
            *("--dataset-name", "prefix_repetition", "--seed", str(a.seed + rep)),
            *("--prefix-repetition-num-prefixes", str(a.prefixes)),
            *("--prefix-repetition-prefix-len", str(a.prefix_len)),
            *("--prefix-repetition-suffix-len", str(a.suffix_len)),
            *("--prefix-repetition-output-len", str(a.output_len)),
            *("--num-prompts", str(a.prefixes * a.prompts_per_prefix)),
            *("--max-concurrency", str(a.concurrency), "--request-rate", "inf"),
            *("--ignore-eos", "--temperature", "0"),
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

    def run_once(self, lm: LiveMode, rep: int) -> dict[str, Any]:
        """One ``vllm bench serve`` run against the mode's server; its result file as a record."""
        out = self.work_dir / "vllm-bench" / f"{lm.name}-rep{rep + 1}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        argv = self.bench_serve_args(lm.server.url, lm.name, rep, out)
        try:
            run_bench_serve(argv, out.with_suffix(".log"), self.args.run_timeout)
        except BenchServeFailed as e:
            raise SideFailed(str(e)) from None
        if not out.exists():
            raise SideFailed(f"vllm bench serve wrote no result: {out.with_suffix('.log')}")
        result = json.loads(out.read_text())
        rec = {k: float(result[k]) for k in RESULT_KEYS}
        for key, value in result.items():
            if LATENCY_KEY.match(key):  # vllm bench serve reports latencies of 0 when none completed
                rec[key] = float(value) if rec["completed"] else math.nan
        return rec

    def workload(self) -> dict[str, Any]:
        shown = self.bench_serve_args("http://127.0.0.1:PORT", "MODE", 0, Path("RESULT_DIR/MODE-rep1.json"))
        requests = self.args.prefixes * self.args.prompts_per_prefix
        return {
            "vllm_bench_serve": ["vllm", "bench", "serve", *shown],
            "requests_per_repetition": requests,
            **super().workload(),
        }


if __name__ == "__main__":
    sys.exit(main(PrefixRepetition))
