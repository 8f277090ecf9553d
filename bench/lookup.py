"""Scheduler lookup cost per 1,000 prompt tokens: a miss and a hit, against the index size (no vLLM).

    python bench/lookup.py [--quick] [--compare main] [--reps 300]

Drives the real scheduler half at the default config (``load_config({}, env={})``: chunks of
256 tokens, the CPU tier, block-granular tails) with stand-in requests, as vLLM would: each
lookup is a new request id, so it hashes the prompt from scratch. A hit is the same prompt
stored by an earlier request (through the planner, so its whole-block tail is stored too);
the index also holds ``others`` unrelated chunks. Prompts of 1,000 and 4,000 tokens end in an
unfull chunk, so a hit also probes the tail's whole-block prefixes; 32,000 is whole chunks.
``+alloc`` adds vLLM's next call (what-if recording, the namespace memory). Each case makes
--reps lookups per 1,000 tokens of prompt (at least 15); medians are reported.

``--compare REF`` runs the ``connector`` package of git revision REF next to the working tree's,
lookups interleaved in one process (this machine is shared: only side-by-side figures compare).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib import fake_requests  # noqa: E402
from bench.lib.runner import Benchmark, Case, Figure, Option, Side, main  # noqa: E402

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
    config = _module(pkg, "config.loading", "config")
    facts = importlib.import_module(f"{pkg.__name__}.engine.facts").EngineFacts(
        "m", "bf16", BLOCK, 1, 1024, "layout", 1, "kv_both"
    )
    scheduler_module = _module(pkg, "scheduler.connector_scheduler", "scheduler")
    sched = scheduler_module.ConnectorScheduler(config.load_config({}, env={}), facts)
    nbytes = facts.chunk_nbytes(sched.config.chunk_size)
    for i in range(others):
        sched.tiers["cpu"].admit(i.to_bytes(16, "little").hex(), nbytes)
    return sched


def _module(pkg: ModuleType, name: str, before: str) -> ModuleType:
    """Module ``name`` of the package, or ``before`` in a revision from before the halves and
    the configuration had folders of their own (``scheduler.py``, ``config.py``)."""
    try:
        return importlib.import_module(f"{pkg.__name__}.{name}")
    except ModuleNotFoundError:
        return importlib.import_module(f"{pkg.__name__}.{before}")


def store(sched: Any, tokens: list[int]) -> None:
    req = request("writer", tokens)
    sched.lookup(req, 0)
    sched.after_alloc(req, 0)
    sched.build_plan(
        fake_requests.scheduler_output(
            [(req, list(range(-(-len(tokens) // BLOCK))))], (), {"writer": len(tokens)}
        )
    )
    sched.finish(req)
    sched.take_done()


def expected_load(prompt_len: int, chunk_size: int) -> int:
    """What a hit loads: the whole chunks and the tail's whole blocks, less the last token."""
    stored = prompt_len - prompt_len % chunk_size + prompt_len % chunk_size // BLOCK * BLOCK
    return stored - 1 if stored >= prompt_len else stored


class Lookup(Benchmark):
    name = "lookup"
    figures = (
        Figure("lookup_us_per_1k_tokens", "lookup µs/1k tokens", "{:.1f}", ratio=True),
        Figure("with_alloc_us_per_1k_tokens", "+alloc µs/1k tokens", "{:.1f}", ratio=True),
    )
    case_label = "case prompt others"
    repeats = (300, 20)
    repeat_flags = ("--reps",)
    options = {"compare": Option(None, help="also run this git revision, side by side")}

    def sides(self) -> list[Side]:
        ref = self.args.compare
        return [Side("tree", "this tree"), *([Side(ref, f"revision {ref}")] if ref else [])]

    def compared_with(self, side: str) -> tuple[str, ...]:
        return (self.args.compare,) if self.args.compare else ()

    def cases(self) -> list[Case]:
        prompts = (1000, 32000) if self.quick else (1000, 4000, 32000)
        sizes = (10, 10_000) if self.quick else (10, 1000, 100_000)
        grid = [(p, 0, False) for p in prompts] + [
            (p, n, hit) for hit in (False, True) for n in sizes for p in prompts
        ]
        reps = self.args.repeats
        return [
            Case(f"{'hit' if hit else 'miss'} {p} {n}", (p, n, hit), max(reps * 1000 // p, 15))
            for p, n, hit in grid
        ]

    @contextlib.contextmanager
    def setup(self) -> Iterator[None]:
        with tempfile.TemporaryDirectory() as tmp:
            self.packages = {
                s.name: package(None if s.name == "tree" else s.name, Path(tmp)) for s in self.modes
            }
            yield

    def start_case(self, case: Case, sides: list[Side]) -> None:
        prompt_len, others, hit = case.params
        self.tokens = [(t * 7919 + 13) % VOCAB for t in range(prompt_len)]
        self.schedulers = {s.name: scheduler(self.packages[s.name], others) for s in sides}
        for sched in self.schedulers.values() if hit else ():
            store(sched, self.tokens)
        chunk = next(iter(self.schedulers.values())).config.chunk_size
        self.expected = expected_load(prompt_len, chunk) if hit else 0
        gc.disable()

    def end_case(self, case: Case) -> None:
        gc.enable()
        for sched in self.schedulers.values():
            sched.shutdown()

    def measure(self, side: Side, case: Case, rep: int) -> dict[str, float]:
        sched, req = self.schedulers[side.name], request(f"r{rep}", self.tokens)
        t0 = time.perf_counter()
        need = sched.lookup(req, 0)
        t1 = time.perf_counter()
        sched.after_alloc(req, need)
        t2 = time.perf_counter()
        if need != self.expected:
            raise AssertionError(f"lookup returned {need} tokens, expected {self.expected}")
        sched.finish(req)
        sched.take_done()
        per_1k = 1e6 * 1000 / len(self.tokens)
        return {
            "lookup_us_per_1k_tokens": (t1 - t0) * per_1k,
            "with_alloc_us_per_1k_tokens": (t2 - t0) * per_1k,
        }

    def workload(self) -> dict[str, Any]:
        return {"block_size": BLOCK, "chunk_size": 256}


if __name__ == "__main__":
    sys.exit(main(Lookup))
