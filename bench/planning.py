"""Scheduler cost per engine step against prompt length and running requests (no vLLM).

Drives the real scheduler half with stand-in requests, as vLLM would: every request is
admitted and prefilled, then the engine decodes one token per request per step. Reports the
time of ``build_plan`` per decode step and of one lookup per 1,000 prompt tokens (the first
lookups of a fresh scheduler; ``bench/lookup.py`` measures misses and hits in detail). Planning
should be flat in prompt length (it reads only each step's new tokens).

    python bench/planning.py [--quick] [--out bench/results/planning.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib.fake_requests import request  # noqa: E402
from connector.config import load_config  # noqa: E402
from connector.engine.facts import EngineFacts  # noqa: E402
from connector.scheduler import ConnectorScheduler  # noqa: E402

BLOCK = 16  # GPU block size: the worst case for per-block work


def output(new=(), cached=(), scheduled=None) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                block_ids=(b,),
                num_computed_tokens=0,
            )
            for r, b in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached],
            resumed_req_ids=set(),
            new_block_ids=[c[1] for c in cached],
            num_computed_tokens=[c[2] for c in cached],
        ),
        num_scheduled_tokens=scheduled or {},
    )


def measure(prompt_len: int, running: int, steps: int) -> dict[str, float]:
    facts = EngineFacts("m", "bf16", BLOCK, 32, 64 * 1024, "layout", 1, "kv_both")
    config = load_config({"lmcache.chunk_size": 256, "lmcache.max_local_cpu_size": 1000}, env={})
    sched = ConnectorScheduler(config, facts)
    reqs = [request(f"r{i}", [(i * 7919 + t) % 32000 for t in range(prompt_len)]) for i in range(running)]
    lookup_s = []
    for r in reqs:
        t0 = time.perf_counter()
        sched.lookup(r, 0)
        lookup_s.append(time.perf_counter() - t0)
        sched.after_alloc(r, 0)
    next_block = 0
    blocks = {}
    for r in reqs:  # one prefill step each
        n = -(-prompt_len // BLOCK)
        blocks[r.request_id] = list(range(next_block, next_block + n))
        next_block += n
        sched.build_plan(output(new=[(r, blocks[r.request_id])], scheduled={r.request_id: prompt_len}))
    per_step = []
    for step in range(steps):
        cached = []
        for r in reqs:
            r.all_token_ids.append(step)
            r.num_tokens += 1
            grow = (r.num_tokens - 1) % BLOCK == 0
            cached.append((r.request_id, ([next_block],) if grow else None, r.num_tokens - 1))
            next_block += grow
        out = output(cached=cached, scheduled={r.request_id: 1 for r in reqs})
        t0 = time.perf_counter()
        sched.build_plan(out)
        per_step.append(time.perf_counter() - t0)
    return {
        "prompt_tokens": prompt_len,
        "running": running,
        "plan_us_per_decode_step": statistics.median(per_step) * 1e6,
        "lookup_us_per_1k_tokens": statistics.median(lookup_s) * 1e6 * 1000 / prompt_len,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few seconds: CI keeps the script working")
    parser.add_argument("--out", default="bench/results/planning.json")
    args = parser.parse_args()
    if args.quick:
        grid, steps = [(1024, 8), (8192, 8)], 20
    else:
        grid = [(p, n) for n in (64, 256) for p in (1024, 4096, 8192, 32768) if p * n <= 4 * 1024 * 1024]
        steps = 100
    rows = [measure(p, n, steps) for p, n in grid]
    base = {n: next(r for r in rows if r["running"] == n)["plan_us_per_decode_step"] for _, n in grid}
    print(f"{'prompt':>7} {'running':>7} {'plan us/step':>13} {'vs shortest':>11} {'lookup us/1k tok':>17}")
    for r in rows:
        ratio = r["plan_us_per_decode_step"] / base[r["running"]]
        r["ratio_to_shortest_prompt"] = ratio
        print(
            f"{r['prompt_tokens']:>7} {r['running']:>7} {r['plan_us_per_decode_step']:>13.1f} {ratio:>11.2f}"
            f" {r['lookup_us_per_1k_tokens']:>17.1f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"block_size": BLOCK, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
