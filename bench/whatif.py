"""What the what-if tracker costs: on the step loop, in the feeder, and in a lookup loop.

    python bench/whatif.py [--quick] [--repeats 5]

Three cases, all in one process at the tracker's default settings:
  record     µs per ``record`` call, the only what-if work on the scheduler's step loop;
  feeder     µs per reference the feeder processes (``drain``), on a Zipf trace of prompts
             against three tiers of 2,000 / 20,000 / 200,000 chunks;
  lookup     a stand-in for the scheduler's lookup (chain-hash each 256-token chunk, find the
             tier holding it, and record it: once per tier, or once with ``tier=None``)
             against the same loop without recording, in turns; and once more with the feeder
             thread live, which shows what the feeder's share of the GIL costs the loop.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib.runner import Benchmark, Case, Figure, Option, Side, main  # noqa: E402
from connector.engine.keys import chain  # noqa: E402
from connector.engine.whatif import WhatIfTracker  # noqa: E402
from tests.unit.whatif_traces import CHUNK, zipf_trace  # noqa: E402

TIERS = {"cpu": 2000 * CHUNK, "disk": 20_000 * CHUNK, "remote": 200_000 * CHUNK}
CHUNK_TOKENS = 256
CASE_SIDES = {"record": ("per-tier",), "feeder": ("live",), "lookup": ("off", "per-tier", "once", "live")}


def bench_record(n: int) -> float:
    tracker = WhatIfTracker(TIERS, buffer_size=n + 1)
    keys = [b"%016d" % i for i in range(n)]
    record = tracker.record
    start = time.perf_counter()
    for key in keys:
        record("cpu", key, CHUNK)
    return (time.perf_counter() - start) / n * 1e6


def bench_feeder(n: int, seed: int) -> dict[str, Any]:
    trace = zipf_trace(n, 2 * n, 0.8, seed=seed)
    tracker = WhatIfTracker(TIERS, buffer_size=3 * len(trace) + 1)
    for item in trace:
        name = item[0].encode()
        for tier in TIERS:
            (tracker.record if len(item) == 2 else tracker.record_store)(tier, name, item[1])
    refs = tracker.pending
    start = time.perf_counter()
    tracker.drain()
    elapsed = time.perf_counter() - start
    rates = {f"sampling_rate_{tier}": curve.rate for tier, curve in tracker.curves.items()}
    return {"feeder_us_per_ref": elapsed / refs * 1e6, **rates}


def prompts(count: int, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(32_000) for _ in range(4 * CHUNK_TOKENS)]
    return [
        shared[: rng.randint(0, 4) * CHUNK_TOKENS]
        + [rng.randrange(32_000) for _ in range(rng.randint(2, 12) * CHUNK_TOKENS)]
        for _ in range(count)
    ]


def lookup_loop(requests: list[list[int]], tracker: WhatIfTracker | None, per_tier: bool = True) -> float:
    """Seconds for one pass: hash each prompt's chunks, find each in an index, record each
    (once per tier, or once for every tier with ``tier=None``)."""
    seed, index = b"\0" * 16, {}
    start = time.perf_counter()
    for tokens in requests:
        parent = seed
        for at in range(0, len(tokens) - CHUNK_TOKENS + 1, CHUNK_TOKENS):
            parent = chain(parent, tokens[at : at + CHUNK_TOKENS])
            index.get(parent)
            if tracker is None:
                continue
            if per_tier:
                for tier in TIERS:
                    tracker.record(tier, parent, CHUNK)
            else:
                tracker.record(None, parent, CHUNK)
    return time.perf_counter() - start


class WhatIfCost(Benchmark):
    name = "whatif"
    figures = (
        Figure("us_per_chunk", "lookup loop µs/chunk", "{:.2f}", ratio=True),
        Figure("live_fed_fraction", "fed while the loop ran", "{:.0%}", plot=False),
        Figure("record_us", "record µs/call", "{:.3f}"),
        Figure("feeder_us_per_ref", "feeder µs/reference", "{:.2f}"),  # sampling rates: in the JSON
    )
    baselines = ("off",)
    repeats = (5, 3)
    repeat_flags = ("--rounds",)
    options = {
        "n": Option(300_000, 50_000, "record calls and feeder trace length"),
        "count": Option(400, 100, "prompts in the lookup loop"),
        "passes": Option(8, 2, "passes over them per measurement"),
    }
    legend = (
        "modes: off (no recording), per-tier (record x3 tiers), once (record(None) once), "
        "live (record(None) with the feeder thread running); per-tier in 'record': one call",
    )

    def sides(self) -> list[Side]:
        return [Side("off"), Side("per-tier"), Side("once"), Side("live")]

    def cases(self) -> list[Case]:
        return [Case("record"), Case("feeder", repeats=1), Case("lookup")]

    def applies(self, side: Side, case: Case) -> bool:
        return side.name in CASE_SIDES[case.name]

    def start_case(self, case: Case, sides: list[Side]) -> None:
        if case.name == "lookup":  # long enough for the feeder thread to wake and work
            self.requests = prompts(self.args.count) * self.args.passes
            self.chunks = sum(len(t) // CHUNK_TOKENS for t in self.requests)

    def measure(self, side: Side, case: Case, rep: int) -> dict[str, Any]:
        if case.name == "record":
            return {"record_us": bench_record(self.args.n)}
        if case.name == "feeder":
            return bench_feeder(self.args.n, seed=11)
        tracker = None if side.name == "off" else WhatIfTracker(TIERS)
        if side.name == "live":
            tracker.start()
        seconds = lookup_loop(self.requests, tracker, per_tier=side.name == "per-tier")
        rec = {"us_per_chunk": seconds * 1e6 / self.chunks}
        if side.name == "live":  # of the references, fed while the loop ran
            rec["live_fed_fraction"] = tracker.processed / (tracker.processed + tracker.pending)
            tracker.close()
        return rec


if __name__ == "__main__":
    sys.exit(main(WhatIfCost))
