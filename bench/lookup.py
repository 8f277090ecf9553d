"""Scheduler lookup cost per 1,000 prompt tokens: a miss and a hit, against the index size (no vLLM).

Drives the real scheduler half at the default config (``load_config({}, env={})``: chunks of
256 tokens, the CPU tier, block-granular tails) with stand-in requests, as vLLM would: each
lookup is a new request id, so it hashes the prompt from scratch. A hit is the same prompt
stored by an earlier request (through the planner, so its whole-block tail is stored too);
the index also holds ``others`` unrelated chunks. Prompts of 1,000 and 4,000 tokens end in an
unfull chunk, so a hit also probes the tail's whole-block prefixes; 32,000 is whole chunks.
``+after_alloc`` adds vLLM's next call (what-if recording, the namespace memory).

    python bench/lookup.py [--quick] [--out bench/results/lookup.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from connector.config import load_config  # noqa: E402
from connector.engine.facts import EngineFacts  # noqa: E402
from connector.scheduler import ConnectorScheduler  # noqa: E402

BLOCK = 16
VOCAB = 128_256  # a Llama-3 vocabulary: ids above 2^16


class ConstantList:
    """vLLM's read-only view of a request's token list (``Request.all_token_ids``)."""

    def __init__(self, tokens: list[int]) -> None:
        self._x = tokens

    def __getitem__(self, item):
        return self._x[item]

    def __len__(self) -> int:
        return len(self._x)

    def __iter__(self):
        return iter(self._x)


def request(rid: str, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid,
        all_token_ids=ConstantList(tokens),
        prompt_token_ids=tokens,
        num_tokens=len(tokens),
        num_prompt_tokens=len(tokens),
        kv_transfer_params=None,
        priority=0,
        cache_salt=None,
        lora_request=None,
        mm_features=None,
        prompt_embeds=None,
    )


def prefill(tokens: list[int], rid: str, block0: int) -> SimpleNamespace:
    """A scheduler output that prefills the whole prompt in one step."""
    blocks = list(range(block0, block0 + -(-len(tokens) // BLOCK)))
    new = SimpleNamespace(req_id=rid, prompt_token_ids=tokens, block_ids=(blocks,), num_computed_tokens=0)
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(
        scheduled_new_reqs=[new], scheduled_cached_reqs=cached, num_scheduled_tokens={rid: len(tokens)}
    )


def scheduler(others: int) -> ConnectorScheduler:
    """Default config; a small KV layout so 100k chunks fit the default 5 GB CPU budget."""
    facts = EngineFacts("m", "bf16", BLOCK, 1, 1024, "layout", 1, "kv_both")
    sched = ConnectorScheduler(load_config({}, env={}), facts)
    cpu = sched.tiers["cpu"]
    nbytes = facts.chunk_nbytes(sched.config.chunk_size)
    for i in range(others):
        cpu.admit(i.to_bytes(16, "little").hex(), nbytes)
    return sched


def store(sched: ConnectorScheduler, tokens: list[int]) -> None:
    req = request("writer", tokens)
    sched.lookup(req, 0)
    sched.after_alloc(req, 0)
    sched.build_plan(prefill(tokens, "writer", 0))
    sched.finish(req)
    sched.take_done()


def expected_load(prompt_len: int, chunk_size: int) -> int:
    """What a hit loads: the whole chunks and the tail's whole blocks, less the last token."""
    stored = prompt_len - prompt_len % chunk_size + prompt_len % chunk_size // BLOCK * BLOCK
    return stored - 1 if stored >= prompt_len else stored


def measure(prompt_len: int, others: int, hit: bool, reps: int) -> dict[str, float | int | bool]:
    tokens = [(t * 7919 + 13) % VOCAB for t in range(prompt_len)]
    sched = scheduler(others)
    if hit:
        store(sched, tokens)
    lookup_s, alloc_s = [], []
    gc.disable()
    try:
        for i in range(reps):
            req = request(f"r{i}", tokens)
            t0 = time.perf_counter()
            need = sched.lookup(req, 0)
            t1 = time.perf_counter()
            sched.after_alloc(req, need)
            t2 = time.perf_counter()
            lookup_s.append(t1 - t0)
            alloc_s.append(t2 - t0)
            sched.finish(req)
            sched.take_done()
    finally:
        gc.enable()
        sched.shutdown()
    expected = expected_load(prompt_len, sched.config.chunk_size) if hit else 0
    if need != expected:
        raise AssertionError(f"lookup returned {need} tokens, expected {expected}")
    per_1k = 1e6 * 1000 / prompt_len
    return {
        "prompt_tokens": prompt_len,
        "others": others,
        "hit": hit,
        "lookup_us_per_1k_tokens": statistics.median(lookup_s) * per_1k,
        "with_alloc_us_per_1k_tokens": statistics.median(alloc_s) * per_1k,
    }


def grid(quick: bool) -> list[tuple[int, int, bool]]:
    prompts = (1000, 4000, 32000) if not quick else (1000, 32000)
    sizes = (10, 1000, 100_000) if not quick else (10, 10_000)
    rows = [(p, 0, False) for p in prompts]
    rows += [(p, n, hit) for hit in (False, True) for n in sizes for p in prompts]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few seconds: CI keeps the script working")
    parser.add_argument("--reps", type=int, default=None, help="lookups per row (median reported)")
    parser.add_argument("--out", default="bench/results/lookup.json")
    args = parser.parse_args()
    reps = args.reps or (20 if args.quick else 200)
    rows = []
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (timings are medians)")
    print(f"{'case':>5} {'prompt':>7} {'others':>7} {'lookup us/1k tok':>17} {'+after_alloc':>13}")
    for prompt_len, others, hit in grid(args.quick):
        row = measure(prompt_len, others, hit, max(reps * 1000 // prompt_len, 15))
        rows.append(row)
        print(
            f"{'hit' if hit else 'miss':>5} {prompt_len:>7} {others:>7}"
            f" {row['lookup_us_per_1k_tokens']:>17.1f} {row['with_alloc_us_per_1k_tokens']:>13.1f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"block_size": BLOCK, "chunk_size": 256, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
