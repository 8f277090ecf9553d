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

from bench.lib import workload as wl  # noqa: E402
from bench.lib.runner import Option, main  # noqa: E402
from bench.lib.served import LiveMode  # noqa: E402


@dataclass(frozen=True, slots=True)
class User:
    context: list[int]  # shared system prompt + the user's own history
    questions: list[list[int]]  # one per round
    filler: list[int]  # the answer a failed request leaves in the history


async def chat(session: aiohttp.ClientSession, url: str, user: User, answer_len: int) -> list[wl.Turn]:
    """One user's rounds, each prompt the whole conversation so far plus the new question."""
    history, turns = list(user.context), []
    for question in user.questions:
        prompt = history + question
        turn = await wl.ask(session, url, prompt, answer_len)
        turns.append(turn)
        history = prompt + list(turn.answer or user.filler)
    return turns


async def conversations(url: str, users: list[User], answer_len: int) -> tuple[list[wl.Turn], float]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max(len(users), 1))) as session:
        t0 = time.perf_counter()
        per_user = await asyncio.gather(*(chat(session, url, u, answer_len) for u in users))
        wall = time.perf_counter() - t0
    return [t for turns in per_user for t in turns], wall


class MultiRoundChat(wl.ThroughputBenchmark):
    name = "multi_round_chat"
    figures = (
        wl.OUTPUT_TPUT,
        wl.TOTAL_TPUT,
        wl.REQUEST_TPUT,
        wl.ttft(50),
        wl.ttft(90),
        wl.ttft(99),
        *wl.COUNTS,
    )
    legend = ("TTFT: lower is better.",)
    seed = 23
    options = {
        "users": Option(6, help="users talking at once"),
        "rounds": Option(5, 3, "questions per user"),
        "system_len": Option(256, 128, "shared system prompt tokens"),
        "history_len": Option(512, 384, "each user's own context tokens"),
        "question_len": Option(32, help="tokens per question"),
        "answer_len": Option(16, 8, "generated tokens per answer"),
        "kv_blocks": Option(
            None, help="vLLM KV blocks in every mode (default: a third of the users)", type=int
        ),
    }

    @property
    def title(self) -> str:
        return f"multi-round chat: {self.args.users} users x {self.args.rounds} rounds, small vLLM KV memory"

    def longest_prompt(self) -> int:
        a = self.args
        return a.system_len + a.history_len + a.rounds * a.question_len + (a.rounds - 1) * a.answer_len

    def sizes(self) -> tuple[int, int, int]:
        a, longest = self.args, self.longest_prompt()
        max_len = longest + a.answer_len + 16
        third = wl.blocks(max_len) * max(1, math.ceil(a.users / 3)) + 1
        return max_len, third, a.system_len + a.users * (longest - a.system_len + a.answer_len)

    def users(self, rep: int) -> list[User]:
        """The users of one repetition: the same for every mode, new in every repetition."""
        a = self.args
        rng = random.Random(a.seed * 1000 + rep)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(10, self.vocab - 1) for _ in range(n)]

        system = tokens(a.system_len)
        return [
            User(
                system + tokens(a.history_len),
                [tokens(a.question_len) for _ in range(a.rounds)],
                tokens(a.answer_len),
            )
            for _ in range(a.users)
        ]

    def run_once(self, lm: LiveMode, rep: int) -> dict[str, Any]:
        turns, wall = asyncio.run(conversations(lm.server.url, self.users(rep), self.args.answer_len))
        return wl.record(turns, wall)

    def workload(self) -> dict[str, Any]:
        a = self.args
        return {
            "requests_per_repetition": a.users * a.rounds,
            "longest_prompt_tokens": self.longest_prompt(),
            **super().workload(),
        }


if __name__ == "__main__":
    sys.exit(main(MultiRoundChat))
