"""Long-document QA: questions about documents that vLLM's own KV memory cannot keep.

    python bench/long_doc_qa.py [--quick] [--modes none,kvlens,example,lmcache]

Shaped like LMCache's long-document QA benchmark (``benchmarks/long_doc_qa``, and the
``long-doc-qa`` workload of ``lmcache bench engine``): --documents documents of --doc-len
tokens each. A warm-up round sends every document once (a one-token answer: the first reader
computes it, and a connector stores its KV); then a query round asks --questions questions
about every document (the document, then a question of --question-len tokens; --answer-len
generated tokens), at most --inflight at a time, in random or tiled order (--order).

Every mode gets the same small vLLM KV memory (``--num-gpu-blocks-override``, default room for
a third of the documents), so by the time a question comes, its document has usually left
vLLM's prefix cache: without a connector it is computed again, with one it is loaded. Each
repetition uses new documents (the same for every mode) after vLLM's prefix cache is flushed;
the modes take turns, and ratios to ``none`` are taken per repetition.

Figures per repetition: the query round's TTFT p50/p90/p99 and throughput (under vllm bench
serve's names), and the warm-up round's wall time (``warmup_duration``: every request a miss,
so a connector's ratio to ``none`` there is what storing costs under load). Prints the tables;
writes .run/bench/results/long_doc_qa.json and .png (see --out).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib import report  # noqa: E402
from bench.lib import workload as wl  # noqa: E402
from bench.lib.client import REQUEST_TIMEOUT_S, stream  # noqa: E402
from bench.lib.models import vocab_size  # noqa: E402
from bench.lib.runner import LiveMode, Run, add_common_args, fill_defaults  # noqa: E402

DEFAULT_MODES = "none,kvlens,example,lmcache"
QUICK_MODES = DEFAULT_MODES
BASELINES = ("none",)
WARMUP = wl.Figure("warmup_duration", "warm-up s", "{:.2f}")
QUERY_ROUND = wl.Figure("duration", "queries s", "{:.2f}")
FIGURES = (wl.ttft(50), wl.ttft(90), wl.ttft(99), wl.TOTAL_TPUT, QUERY_ROUND, WARMUP)
RATIO_KEYS = [f.key for f in FIGURES]
RATIO_TABLE = (wl.ttft(50), wl.ttft(90), wl.TOTAL_TPUT, WARMUP)


class Documents:
    """One repetition's documents and question schedule: the same for every mode."""

    def __init__(self, args: argparse.Namespace, rep: int, vocab: int) -> None:
        rng = random.Random(args.seed * 1000 + rep)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(10, vocab - 1) for _ in range(n)]

        self.texts = [tokens(args.doc_len) for _ in range(args.documents)]
        self.questions = [[tokens(args.question_len) for _ in range(args.questions)] for _ in self.texts]
        # Tiled: every document's first question, then every document's second, ...
        self.schedule = [(d, q) for q in range(args.questions) for d in range(args.documents)]
        if args.order == "random":
            rng.shuffle(self.schedule)

    def prompts(self) -> list[list[int]]:
        return [self.texts[d] + self.questions[d][q] for d, q in self.schedule]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("workload")
    g.add_argument("--documents", type=int, help="documents per repetition (default 8; --quick 4)")
    g.add_argument("--doc-len", type=int, help="tokens per document (default 3000; --quick 600)")
    g.add_argument("--questions", type=int, help="questions per document (default 2)")
    g.add_argument("--question-len", type=int, help="tokens per question (default 32)")
    g.add_argument("--answer-len", type=int, help="generated tokens per answer (default 16; --quick 8)")
    g.add_argument("--inflight", type=int, help="requests in flight at once (default 2)")
    g.add_argument("--order", choices=("random", "tile"), default="random", help="order of the questions")
    g.add_argument(
        "--kv-blocks", type=int, help="vLLM KV blocks in every mode (default: a third of the documents)"
    )
    g.add_argument("--repeats", type=int, help="runs per mode, in turns (default 3; --quick 2)")
    g.add_argument("--seed", type=int, default=31, help="seed of the first repetition's documents")
    add_common_args(p, DEFAULT_MODES, QUICK_MODES)
    p.set_defaults(kvlens_tiers="cpu")
    args = p.parse_args(argv)
    full = {"documents": 8, "doc_len": 3000, "questions": 2, "question_len": 32, "answer_len": 16}
    full |= {"inflight": 2, "repeats": 3}
    quick = {**full, "documents": 4, "doc_len": 600, "answer_len": 8, "repeats": 2}
    fill_defaults(args, quick, full)
    for key in ("documents", "doc_len", "questions", "question_len", "answer_len", "inflight", "repeats"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be at least 1")
    return args


async def ask(
    session: aiohttp.ClientSession, url: str, prompt: list[int], answer_len: int, gate: asyncio.Semaphore
) -> wl.Turn:
    async with gate:
        t0 = time.perf_counter()
        try:
            done = await stream(session, url, prompt, answer_len, timeout=REQUEST_TIMEOUT_S)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            late = time.perf_counter() - t0
            return wl.Turn(False, math.nan, late, len(prompt), 0, report.first_line(repr(e), 200))
    return wl.Turn(
        True,
        done.ttft,
        done.latency,
        done.prompt_tokens,
        len(done.token_ids),
        cached_tokens=done.cached_tokens,
    )


async def _round(
    url: str, prompts: list[list[int]], answer_len: int, inflight: int
) -> tuple[list[wl.Turn], float]:
    """Every prompt, at most ``inflight`` at a time, in the order given; returns the turns in
    that order and the round's wall time."""
    gate = asyncio.Semaphore(inflight)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=inflight)) as session:
        t0 = time.perf_counter()
        turns = await asyncio.gather(*(ask(session, url, p, answer_len, gate) for p in prompts))
        return list(turns), time.perf_counter() - t0


def measure(bench: Run, lm: LiveMode, rep: int, vocab: int) -> wl.Record:
    args = bench.args
    docs = Documents(args, rep, vocab)
    warm, warm_wall = asyncio.run(_round(lm.server.url, docs.texts, 1, args.inflight))
    queries, wall = asyncio.run(_round(lm.server.url, docs.prompts(), args.answer_len, args.inflight))
    errors = sorted({t.error for t in (*warm, *queries) if not t.ok})
    if errors:
        print(f"   {lm.mode.name}: {len(errors)} kind(s) of error, e.g. {errors[0]}", flush=True)
    rec = wl.record(queries, wall)  # the query round's figures
    warm_failed = sum(not t.ok for t in warm)
    rec.update(
        {
            "warmup_duration": warm_wall,
            "completed": rec["completed"] + len(warm) - warm_failed,
            "failed": rec["failed"] + warm_failed,
            # Prompt tokens the query round got from a cache (vLLM's or the connector's).
            "query_cached_tokens": sum(t.cached_tokens for t in queries if t.ok),
            "errors": errors,  # the raw JSON keeps them; summaries take numbers only
        }
    )
    return rec


def warm_up(lm: LiveMode, doc_len: int, vocab: int) -> None:
    """Every path the rounds take, once, on a document of its own (computed and stored, vLLM's
    prefix hit, a connector's hit after a flush), so that no repetition pays a server's
    first-request costs (allocations, kernel set-up)."""
    rng = random.Random(-1)
    prompt = [rng.randrange(10, vocab - 1) for _ in range(doc_len)]
    lm.client.complete(prompt)
    lm.client.complete(prompt)
    lm.client.reset_prefix_cache()
    lm.client.complete(prompt)


def run(args: argparse.Namespace) -> int:
    bench = Run("long_doc_qa", args, DEFAULT_MODES, QUICK_MODES)
    queries = args.documents * args.questions
    bench.header(
        f"{args.documents} documents x {args.doc_len} tokens, {args.questions} questions each "
        f"({args.question_len} tokens, {args.answer_len}-token answers, {args.order} order), "
        f"{args.inflight} in flight, {args.repeats} repetitions"
    )
    vocab = vocab_size(Path(bench.model))
    longest = args.doc_len + args.question_len
    max_len = longest + args.answer_len + 16
    third = wl.blocks(max_len) * max(1, math.ceil(args.documents / 3)) + 1
    working_set = args.documents * (longest + args.answer_len)
    shape, sizes = wl.small_kv_shape(bench, max_len, args.kv_blocks or third, working_set)
    records = wl.measure_in_turns(
        bench,
        shape,
        args.repeats,
        lambda lm, rep: measure(bench, lm, rep, vocab),
        warm_up=lambda lm: warm_up(lm, args.doc_len, vocab),
    )
    summary = wl.summarize(bench, records, RATIO_KEYS, BASELINES)
    bench.finish(
        {
            "settings": wl.args_json(args),
            "workload": {
                "requests_per_repetition": args.documents + queries,
                "queries_per_repetition": queries,
                "query_prompt_tokens_per_repetition": queries * longest,
                **sizes,
            },
            "ratios": wl.headline(summary, RATIO_KEYS, BASELINES),
            "unavailable": dict(bench.skipped),
            "summary": summary,
            "raw": records,
        },
        table(bench, summary),
        f"long-document QA: {args.documents} x {args.doc_len}-token documents, small vLLM KV memory",
        panels(summary),
    )
    return 0 if summary else 1


def table(bench: Run, summary: dict[str, Any]) -> str:
    lines = [wl.figures_table(bench, summary, FIGURES), ""]
    lines.append(
        "Ratios to none, per repetition (median, min..max). TTFT and the warm-up round (every request "
        "a miss: the cost of storing): lower is better."
    )
    lines.append(wl.ratios_table(bench, summary, RATIO_TABLE, BASELINES))
    return "\n".join(lines)


def panels(summary: dict[str, Any]) -> list[report.Panel]:
    out = [
        wl.figure_panel(
            "query round: time to first token",
            "ms",
            summary,
            [wl.ttft(50), wl.ttft(90), wl.ttft(99)],
            log=True,
        ),
        wl.figure_panel("round wall time (median, min..max)", "s", summary, [WARMUP, QUERY_ROUND]),
    ]
    if "none" in summary:
        out.append(wl.ratio_panel(summary, "none", RATIO_TABLE, log=True))  # 0.05x TTFT beside 9x tok/s
    out.append(wl.sources_panel(summary))
    return out


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
