"""Scheduler lookup cost per 1,000 prompt tokens: a miss and a hit, against the index size (no vLLM).

Drives the real scheduler half at the default config (``load_config({}, env={})``: chunks of
256 tokens, the CPU tier, block-granular tails) with stand-in requests, as vLLM would: each
lookup is a new request id, so it hashes the prompt from scratch. A hit is the same prompt
stored by an earlier request (through the planner, so its whole-block tail is stored too);
the index also holds ``others`` unrelated chunks. Prompts of 1,000 and 4,000 tokens end in an
unfull chunk, so a hit also probes the tail's whole-block prefixes; 32,000 is whole chunks.
``+after_alloc`` adds vLLM's next call (what-if recording, the namespace memory).

``--compare REF`` runs the ``connector`` package of git revision REF next to the working tree's,
lookups interleaved in one process (this machine is shared: only side-by-side figures compare).

    python bench/lookup.py [--quick] [--compare main] [--out bench/results/lookup.json]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib import fake_requests  # noqa: E402

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
    return fake_requests.request(rid, tokens, ConstantList(tokens))


def prefill(tokens: list[int], rid: str) -> SimpleNamespace:
    """A scheduler output that prefills the whole prompt in one step."""
    blocks = list(range(-(-len(tokens) // BLOCK)))
    new = SimpleNamespace(req_id=rid, prompt_token_ids=tokens, block_ids=(blocks,), num_computed_tokens=0)
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(
        scheduled_new_reqs=[new], scheduled_cached_reqs=cached, num_scheduled_tokens={rid: len(tokens)}
    )


def package(ref: str | None, into: Path) -> ModuleType:
    """The working tree's ``connector``, or revision ``ref``'s under another package name."""
    if ref is None:
        return importlib.import_module("connector")
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", ref, "connector"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "connector").rename(into / "kvlens_ref")
    sys.path.insert(0, str(into))
    return importlib.import_module("kvlens_ref")  # its own imports are relative


def scheduler(pkg: ModuleType, others: int) -> Any:
    """Default config; a small KV layout so 100k chunks fit the default 5 GB CPU budget."""
    config = importlib.import_module(f"{pkg.__name__}.config")
    facts = importlib.import_module(f"{pkg.__name__}.engine.facts").EngineFacts(
        "m", "bf16", BLOCK, 1, 1024, "layout", 1, "kv_both"
    )
    sched = importlib.import_module(f"{pkg.__name__}.scheduler").ConnectorScheduler(
        config.load_config({}, env={}), facts
    )
    nbytes = facts.chunk_nbytes(sched.config.chunk_size)
    for i in range(others):
        sched.tiers["cpu"].admit(i.to_bytes(16, "little").hex(), nbytes)
    return sched


def store(sched: Any, tokens: list[int]) -> None:
    req = request("writer", tokens)
    sched.lookup(req, 0)
    sched.after_alloc(req, 0)
    sched.build_plan(prefill(tokens, "writer"))
    sched.finish(req)
    sched.take_done()


def expected_load(prompt_len: int, chunk_size: int) -> int:
    """What a hit loads: the whole chunks and the tail's whole blocks, less the last token."""
    stored = prompt_len - prompt_len % chunk_size + prompt_len % chunk_size // BLOCK * BLOCK
    return stored - 1 if stored >= prompt_len else stored


def measure(pkgs: list[ModuleType], prompt_len: int, others: int, hit: bool, reps: int) -> list[dict]:
    """One row per package, their lookups interleaved (alternating which goes first)."""
    tokens = [(t * 7919 + 13) % VOCAB for t in range(prompt_len)]
    scheds = [scheduler(pkg, others) for pkg in pkgs]
    for sched in scheds if hit else ():
        store(sched, tokens)
    expected = expected_load(prompt_len, scheds[0].config.chunk_size) if hit else 0
    lookup_s: list[list[float]] = [[] for _ in scheds]
    alloc_s: list[list[float]] = [[] for _ in scheds]
    gc.disable()
    try:
        for i in range(reps):
            for j in range(len(scheds)) if i % 2 else reversed(range(len(scheds))):
                req = request(f"r{i}", tokens)
                t0 = time.perf_counter()
                need = scheds[j].lookup(req, 0)
                t1 = time.perf_counter()
                scheds[j].after_alloc(req, need)
                t2 = time.perf_counter()
                lookup_s[j].append(t1 - t0)
                alloc_s[j].append(t2 - t0)
                if need != expected:
                    raise AssertionError(f"lookup returned {need} tokens, expected {expected}")
                scheds[j].finish(req)
                scheds[j].take_done()
    finally:
        gc.enable()
        for sched in scheds:
            sched.shutdown()
    per_1k = 1e6 * 1000 / prompt_len
    return [
        {
            "prompt_tokens": prompt_len,
            "others": others,
            "hit": hit,
            "lookup_us_per_1k_tokens": statistics.median(lookup_s[j]) * per_1k,
            "with_alloc_us_per_1k_tokens": statistics.median(alloc_s[j]) * per_1k,
        }
        for j in range(len(scheds))
    ]


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
    parser.add_argument("--compare", metavar="REF", help="also run this git revision, side by side")
    parser.add_argument("--out", default="bench/results/lookup.json")
    args = parser.parse_args()
    reps = args.reps or (20 if args.quick else 300)
    with tempfile.TemporaryDirectory() as tmp:
        pkgs = [package(None, Path(tmp))] + ([package(args.compare, Path(tmp))] if args.compare else [])
        names = ["this tree"] + ([args.compare] if args.compare else [])
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; medians, us per 1k tokens")
        print(" " * 21 + "".join(f" | {name[:15]:>15}" for name in names))
        ratio = " | this/ref" if args.compare else ""
        print(f"{'case':>5} {'prompt':>7} {'others':>7}" + " | lookup  +alloc" * len(names) + ratio)
        rows: dict[str, list[dict]] = {name: [] for name in names}
        for prompt_len, others, hit in grid(args.quick):
            measured = measure(pkgs, prompt_len, others, hit, max(reps * 1000 // prompt_len, 15))
            line = f"{'hit' if hit else 'miss':>5} {prompt_len:>7} {others:>7}"
            for name, row in zip(names, measured, strict=True):
                rows[name].append(row)
                line += (
                    f" | {row['lookup_us_per_1k_tokens']:>6.1f} {row['with_alloc_us_per_1k_tokens']:>7.1f}"
                )
            if args.compare:
                this, ref = (row["lookup_us_per_1k_tokens"] for row in measured)
                line += f" | {this / ref:>8.2f}"
            print(line, flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"block_size": BLOCK, "chunk_size": 256, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
