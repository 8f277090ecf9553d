"""Scheduler cost per engine step against prompt length and running requests (no vLLM).

    python bench/planning.py [--quick] [--steps 100]

Drives the real scheduler half with stand-in requests, as vLLM would: every request is
admitted and prefilled, then the engine decodes one token per request per step. The modes are
prompt lengths, each its own scheduler with the case's number of running requests, stepped in
turns; reported: the time of ``build_plan`` per decode step, its ratio to the shortest prompt's
in the same step (planning should be flat in prompt length: it reads only each step's new
tokens), and one lookup per 1,000 prompt tokens (the first lookups of a fresh scheduler;
``bench/lookup.py`` measures misses and hits in detail).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib.fake_requests import request, scheduler_output  # noqa: E402
from bench.lib.runner import Benchmark, Case, Figure, Side, main  # noqa: E402
from connector.config.loading import load_config  # noqa: E402
from connector.engine.facts import EngineFacts  # noqa: E402
from connector.scheduler.connector_scheduler import ConnectorScheduler  # noqa: E402

BLOCK = 16  # GPU block size: the worst case for per-block work
MAX_TOKENS_RUNNING = 4 * 1024 * 1024  # prompt x running requests in one case


class Engine:
    """One scheduler with ``running`` requests of ``prompt_len`` tokens, admitted and prefilled."""

    def __init__(self, prompt_len: int, running: int) -> None:
        facts = EngineFacts("m", "bf16", BLOCK, 32, 64 * 1024, "layout", 1, "kv_both")
        config = load_config({"lmcache.chunk_size": 256, "lmcache.max_local_cpu_size": 1000}, env={})
        self.sched = ConnectorScheduler(config, facts)
        self.reqs = [
            request(f"r{i}", [(i * 7919 + t) % 32000 for t in range(prompt_len)]) for i in range(running)
        ]
        self.lookup_us_per_1k = []
        for r in self.reqs:
            t0 = time.perf_counter()
            self.sched.lookup(r, 0)
            self.lookup_us_per_1k.append((time.perf_counter() - t0) * 1e6 * 1000 / prompt_len)
            self.sched.after_alloc(r, 0)
        self.next_block = 0
        for r in self.reqs:  # one prefill step each
            n = -(-prompt_len // BLOCK)
            blocks = list(range(self.next_block, self.next_block + n))
            self.next_block += n
            self.sched.build_plan(scheduler_output(new=[(r, blocks)], scheduled={r.request_id: prompt_len}))

    def decode_step(self, step: int) -> float:
        """Seconds ``build_plan`` takes for one decode step of every request."""
        cached = []
        for r in self.reqs:
            r.all_token_ids.append(step)
            r.num_tokens += 1
            grow = (r.num_tokens - 1) % BLOCK == 0
            cached.append((r.request_id, ([self.next_block],) if grow else None, r.num_tokens - 1))
            self.next_block += grow
        out = scheduler_output(cached=cached, scheduled={r.request_id: 1 for r in self.reqs})
        t0 = time.perf_counter()
        self.sched.build_plan(out)
        return time.perf_counter() - t0


class Planning(Benchmark):
    name = "planning"
    figures = (
        Figure("plan_us_per_decode_step", "plan µs/step", "{:.1f}", ratio=True),
        Figure("lookup_us_per_1k_tokens", "lookup µs/1k tokens", "{:.1f}"),
    )
    case_label = "running"
    repeats = (100, 20)
    repeat_flags = ("--steps",)

    def sides(self) -> list[Side]:
        prompts = (1024, 8192) if self.quick else (1024, 4096, 8192, 32768)
        return [Side(str(p), f"{p}-token prompts") for p in prompts]

    def cases(self) -> list[Case]:
        return [Case(str(n), n) for n in ((8,) if self.quick else (64, 256))]

    def applies(self, side: Side, case: Case) -> bool:
        return int(side.name) * case.params <= MAX_TOKENS_RUNNING

    def compared_with(self, side: str) -> tuple[str, ...]:
        return (self.modes[0].name,)  # the shortest prompt

    def start_case(self, case: Case, sides: list[Side]) -> None:
        self.engines = {s.name: Engine(int(s.name), case.params) for s in sides}

    def measure(self, side: Side, case: Case, rep: int) -> dict[str, Any]:
        engine = self.engines[side.name]
        rec: dict[str, Any] = {"plan_us_per_decode_step": engine.decode_step(rep) * 1e6}
        if rep == 0:
            rec["lookup_us_per_1k_tokens"] = engine.lookup_us_per_1k
        return rec

    def workload(self) -> dict[str, Any]:
        return {"block_size": BLOCK, "chunk_size": 256}


if __name__ == "__main__":
    sys.exit(main(Planning))
