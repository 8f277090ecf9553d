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

import asyncio
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib import ttft  # noqa: E402
from bench.lib import workload as wl  # noqa: E402
from bench.lib.runner import Figure, Option, main  # noqa: E402
from bench.lib.served import LiveMode  # noqa: E402

WARMUP = Figure("warmup_duration", "warm-up s", "{:.2f}", ratio=True, panel="round wall time")
QUERY_ROUND = Figure("duration", "queries s", "{:.2f}", panel="round wall time")


class Documents:
    """One repetition's documents and question schedule: the same for every mode."""

    def __init__(self, args: Any, rep: int, vocab: int) -> None:
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


async def one_round(
    url: str, prompts: list[list[int]], answer_len: int, inflight: int
) -> tuple[list[wl.Turn], float]:
    """Every prompt, at most ``inflight`` at a time, in the order given; the turns in that order
    and the round's wall time."""
    gate = asyncio.Semaphore(inflight)

    async def gated(session: aiohttp.ClientSession, prompt: list[int]) -> wl.Turn:
        async with gate:
            return await wl.ask(session, url, prompt, answer_len)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=inflight)) as session:
        t0 = time.perf_counter()
        turns = await asyncio.gather(*(gated(session, p) for p in prompts))
        return list(turns), time.perf_counter() - t0


class LongDocQA(wl.ThroughputBenchmark):
    name = "long_doc_qa"
    figures = (
        wl.ttft(50),
        wl.ttft(90),
        wl.ttft(99, ratio=False),
        wl.TOTAL_TPUT,
        QUERY_ROUND,
        WARMUP,
        *wl.COUNTS,
    )
    legend = ("TTFT and the warm-up round (every request a miss: the cost of storing): lower is better.",)
    seed = 31
    options = {
        "documents": Option(8, 4, "documents per repetition"),
        "doc_len": Option(3000, 600, "tokens per document"),
        "questions": Option(2, help="questions per document"),
        "question_len": Option(32, help="tokens per question"),
        "answer_len": Option(16, 8, "generated tokens per answer"),
        "inflight": Option(2, help="requests in flight at once"),
        "order": Option("random", help="order of the questions", choices=("random", "tile")),
        "kv_blocks": Option(
            None, help="vLLM KV blocks in every mode (default: a third of the documents)", type=int
        ),
    }

    @property
    def title(self) -> str:
        a = self.args
        return f"long-document QA: {a.documents} x {a.doc_len}-token documents, small vLLM KV memory"

    def sizes(self) -> tuple[int, int, int]:
        a = self.args
        for key in ("documents", "doc_len", "questions", "question_len", "answer_len", "inflight"):
            if getattr(a, key) < 1:
                raise SystemExit(f"--{key.replace('_', '-')} must be at least 1")
        longest = a.doc_len + a.question_len
        max_len = longest + a.answer_len + 16
        third = wl.blocks(max_len) * max(1, math.ceil(a.documents / 3)) + 1
        return max_len, third, a.documents * (longest + a.answer_len)

    def warm_up(self, lm: LiveMode) -> None:
        """Every path the rounds take, once, on a document of its own, so that no repetition pays a
        server's first-request costs (allocations, kernel set-up)."""
        ttft.warm_up(lm.client, ttft.prompt(-1, self.args.doc_len, self.vocab))

    def run_once(self, lm: LiveMode, rep: int) -> dict[str, Any]:
        a, url = self.args, lm.server.url
        docs = Documents(a, rep, self.vocab)
        warm, warm_wall = asyncio.run(one_round(url, docs.texts, 1, a.inflight))
        queries, wall = asyncio.run(one_round(url, docs.prompts(), a.answer_len, a.inflight))
        rec = wl.record(queries, wall)  # the query round's figures
        warm_failed = sum(not t.ok for t in warm)
        return rec | {
            "warmup_duration": warm_wall,
            "completed": rec["completed"] + len(warm) - warm_failed,
            "failed": rec["failed"] + warm_failed,
            # Prompt tokens the query round got from a cache (vLLM's or the connector's).
            "query_cached_tokens": sum(t.cached_tokens for t in queries if t.ok),
            "errors": sorted({*rec["errors"], *(t.error for t in warm if not t.ok)}),
        }

    def workload(self) -> dict[str, Any]:
        a = self.args
        queries = a.documents * a.questions
        return {
            "requests_per_repetition": a.documents + queries,
            "queries_per_repetition": queries,
            "query_prompt_tokens_per_repetition": queries * (a.doc_len + a.question_len),
            **super().workload(),
        }


if __name__ == "__main__":
    sys.exit(main(LongDocQA))
