"""Multi-round chat: many users with growing histories that do not fit vLLM's KV memory.

    python bench/multi_round_chat.py [--quick] [--modes none,kvlens,example,lmcache]

Shaped like LMCache's multi-round QA benchmark (``benchmarks/multi_round_qa``): --users users
talk at once; every user's prompt is a system prompt shared by all users (--system-len tokens),
the user's own context (--history-len), then, round after round, the previous questions and
answers and a new question (--question-len); each answer is --answer-len generated tokens and
joins the history. A user asks its next question as soon as its previous answer is complete.
Prompts are token ids, so every mode is sent the same tokens; answers are greedy.

Every mode gets the same small vLLM KV memory (``--num-gpu-blocks-override``, default: room for
the longest prompts of a third of the users), so a user's history is usually gone from vLLM's prefix cache
when the user comes back: without a connector it is recomputed. Each repetition uses new users
(seed + repetition, the same for every mode) after vLLM's prefix cache is flushed; the modes
take turns, and ratios to ``none`` are taken per repetition.

Figures per repetition (the names of vllm bench serve's result file): throughput over the run's
wall time (total and output tokens/s, requests/s), TTFT p50/p90/p99 over every request, failed
requests. Prints the tables; writes .run/bench/results/multi_round_chat.json and .png (see --out).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
from dataclasses import dataclass
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
FIGURES = (wl.OUTPUT_TPUT, wl.TOTAL_TPUT, wl.REQUEST_TPUT, wl.ttft(50), wl.ttft(90), wl.ttft(99))
RATIO_KEYS = [f.key for f in FIGURES]
RATIO_TABLE = (wl.TOTAL_TPUT, wl.ttft(50), wl.ttft(90), wl.ttft(99))


@dataclass(frozen=True, slots=True)
class User:
    context: list[int]  # shared system prompt + the user's own history
    questions: list[list[int]]  # one per round
    filler: list[int]  # the answer a failed request leaves in the history


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("workload")
    g.add_argument("--users", type=int, help="users talking at once (default 6)")
    g.add_argument("--rounds", type=int, help="questions per user (default 5; --quick 3)")
    g.add_argument("--system-len", type=int, help="shared system prompt tokens (default 256; --quick 128)")
    g.add_argument(
        "--history-len", type=int, help="each user's own context tokens (default 512; --quick 384)"
    )
    g.add_argument("--question-len", type=int, help="tokens per question (default 32)")
    g.add_argument("--answer-len", type=int, help="generated tokens per answer (default 16; --quick 8)")
    g.add_argument(
        "--kv-blocks", type=int, help="vLLM KV blocks in every mode (default: a third of the users)"
    )
    g.add_argument("--repeats", type=int, help="runs per mode, in turns (default 3; --quick 2)")
    g.add_argument("--seed", type=int, default=23, help="seed of the first repetition's users")
    add_common_args(p, DEFAULT_MODES, QUICK_MODES)
    p.set_defaults(kvlens_tiers="cpu")
    args = p.parse_args(argv)
    full = {"users": 6, "rounds": 5, "system_len": 256, "history_len": 512, "question_len": 32}
    full |= {"answer_len": 16, "repeats": 3}
    quick = {**full, "rounds": 3, "system_len": 128, "history_len": 384, "answer_len": 8}
    quick["repeats"] = 2
    fill_defaults(args, quick, full)
    return args


def longest_prompt(args: argparse.Namespace) -> int:
    return (
        args.system_len
        + args.history_len
        + args.rounds * args.question_len
        + (args.rounds - 1) * args.answer_len
    )


def make_users(args: argparse.Namespace, rep: int, vocab: int) -> list[User]:
    """The users of one repetition: the same for every mode, new in every repetition."""
    rng = random.Random(args.seed * 1000 + rep)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, vocab - 1) for _ in range(n)]

    system = tokens(args.system_len)
    return [
        User(
            context=system + tokens(args.history_len),
            questions=[tokens(args.question_len) for _ in range(args.rounds)],
            filler=tokens(args.answer_len),
        )
        for _ in range(args.users)
    ]


async def chat(session: aiohttp.ClientSession, url: str, user: User, answer_len: int) -> list[wl.Turn]:
    """One user's rounds, each prompt the whole conversation so far plus the new question."""
    history = list(user.context)
    turns = []
    for question in user.questions:
        prompt = history + question
        t0 = time.perf_counter()
        try:
            done = await stream(session, url, prompt, answer_len, timeout=REQUEST_TIMEOUT_S)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            late = time.perf_counter() - t0
            turns.append(wl.Turn(False, math.nan, late, len(prompt), 0, report.first_line(repr(e), 200)))
            history = prompt + user.filler
            continue
        turns.append(wl.Turn(True, done.ttft, done.latency, done.prompt_tokens, len(done.token_ids)))
        history = prompt + list(done.token_ids or user.filler)
    return turns


async def _conversations(url: str, users: list[User], answer_len: int) -> tuple[list[wl.Turn], float]:
    connector = aiohttp.TCPConnector(limit=max(len(users), 1))
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()
        per_user = await asyncio.gather(*(chat(session, url, u, answer_len) for u in users))
        wall = time.perf_counter() - t0
    return [t for turns in per_user for t in turns], wall


def measure(bench: Run, lm: LiveMode, rep: int, vocab: int) -> wl.Record:
    args = bench.args
    turns, wall = asyncio.run(_conversations(lm.server.url, make_users(args, rep, vocab), args.answer_len))
    errors = sorted({t.error for t in turns if not t.ok})
    if errors:
        print(f"   {lm.mode.name}: {len(errors)} kind(s) of error, e.g. {errors[0]}", flush=True)
    rec = wl.record(turns, wall)
    rec["errors"] = errors  # the raw JSON keeps them; summaries take numbers only
    return rec


def run(args: argparse.Namespace) -> int:
    bench = Run("multi_round_chat", args, DEFAULT_MODES, QUICK_MODES)
    bench.header(
        f"{args.users} users x {args.rounds} rounds: {args.system_len} shared + {args.history_len} own "
        f"tokens, +{args.question_len} per question, {args.answer_len}-token answers, "
        f"{args.repeats} repetitions"
    )
    vocab = vocab_size(Path(bench.model))
    longest = longest_prompt(args)
    max_len = longest + args.answer_len + 16
    third = wl.blocks(max_len) * max(1, math.ceil(args.users / 3)) + 1
    working_set = args.system_len + args.users * (longest - args.system_len + args.answer_len)
    shape, sizes = wl.small_kv_shape(bench, max_len, args.kv_blocks or third, working_set)
    records = wl.measure_in_turns(bench, shape, args.repeats, lambda lm, rep: measure(bench, lm, rep, vocab))
    summary = wl.summarize(bench, records, RATIO_KEYS, BASELINES)
    bench.finish(
        {
            "settings": wl.args_json(args),
            "workload": {
                "requests_per_repetition": args.users * args.rounds,
                "longest_prompt_tokens": longest,
                **sizes,
            },
            "ratios": wl.headline(summary, RATIO_KEYS, BASELINES),
            "unavailable": dict(bench.skipped),
            "summary": summary,
            "raw": records,
        },
        table(bench, summary),
        f"multi-round chat: {args.users} users x {args.rounds} rounds, small vLLM KV memory",
        panels(summary),
    )
    return 0 if summary else 1


def table(bench: Run, summary: dict[str, Any]) -> str:
    lines = [wl.figures_table(bench, summary, FIGURES), ""]
    lines.append("Ratios to none, per repetition (median, min..max); TTFT: lower is better.")
    lines.append(wl.ratios_table(bench, summary, RATIO_TABLE, BASELINES))
    return "\n".join(lines)


def panels(summary: dict[str, Any]) -> list[report.Panel]:
    out = [
        wl.figure_panel("throughput per mode (median, min..max)", "tokens/s", summary, [wl.TOTAL_TPUT]),
        wl.figure_panel(
            "time to first token", "ms", summary, [wl.ttft(50), wl.ttft(90), wl.ttft(99)], log=True
        ),
    ]
    if "none" in summary:
        out.append(wl.ratio_panel(summary, "none", RATIO_TABLE))
    out.append(wl.sources_panel(summary))
    return out


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
