"""What the what-if tracker costs: on the step loop, in the feeder, and in a lookup loop.

Three figures, all in one process at the tracker's default settings:
  record     µs per ``record`` call, the only what-if work on the scheduler's step loop;
  feeder     µs per reference the feeder processes (``drain``), on a Zipf trace of prompts
             against three tiers of 2,000 / 20,000 / 200,000 chunks;
  lookup     a stand-in for the scheduler's lookup (chain-hash each 256-token chunk, find the
             tier holding it, and record it: once per tier, or once with ``tier=None``)
             against the same loop without recording, runs interleaved; and once more with the
             feeder thread live, which shows what the feeder's share of the GIL costs the loop.

    python bench/whatif.py [--quick] [--out .run/bench/whatif.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from connector.engine.keys import chain  # noqa: E402
from connector.engine.whatif import WhatIfTracker  # noqa: E402
from tests.unit.whatif_traces import CHUNK, zipf_trace  # noqa: E402

TIERS = {"cpu": 2000 * CHUNK, "disk": 20_000 * CHUNK, "remote": 200_000 * CHUNK}
CHUNK_TOKENS = 256


def bench_record(n: int) -> float:
    tracker = WhatIfTracker(TIERS, buffer_size=n + 1)
    keys = [b"%016d" % i for i in range(n)]
    record = tracker.record
    start = time.perf_counter()
    for key in keys:
        record("cpu", key, CHUNK)
    return (time.perf_counter() - start) / n * 1e6


def bench_feeder(n: int) -> tuple[float, dict[str, float]]:
    trace = zipf_trace(n, 2 * n, 0.8, seed=11)
    tracker = WhatIfTracker(TIERS, buffer_size=3 * len(trace) + 1)
    for item in trace:
        name = item[0].encode()
        for tier in TIERS:
            (tracker.record if len(item) == 2 else tracker.record_store)(tier, name, item[1])
    refs = tracker.pending
    start = time.perf_counter()
    tracker.drain()
    elapsed = time.perf_counter() - start
    rates = {tier: curve.rate for tier, curve in tracker.curves.items()}
    return elapsed / refs * 1e6, rates


def prompts(count: int, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(32_000) for _ in range(4 * CHUNK_TOKENS)]
    return [
        shared[: rng.randint(0, 4) * CHUNK_TOKENS]
        + [rng.randrange(32_000) for _ in range(rng.randint(2, 12) * CHUNK_TOKENS)]
        for _ in range(count)
    ]


def lookup_loop(
    requests: list[list[int]], index: dict[bytes, str], tracker: WhatIfTracker | None, per_tier: bool = True
) -> float:
    """Seconds for one pass: hash each prompt's chunks, find each in the index, record each
    (once per tier, or once for every tier with ``tier=None``)."""
    seed = b"\0" * 16
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


def bench_lookup(count: int, passes: int, rounds: int) -> dict[str, float]:
    requests = prompts(count) * passes  # long enough for the feeder thread to wake and work
    chunks = sum(len(t) // CHUNK_TOKENS for t in requests)
    index: dict[bytes, str] = {}
    off, on, one, live, fed = [], [], [], [], []
    for _ in range(rounds):
        off.append(lookup_loop(requests, index, None))
        tracker = WhatIfTracker(TIERS)
        on.append(lookup_loop(requests, index, tracker))
        one.append(lookup_loop(requests, index, WhatIfTracker(TIERS), per_tier=False))
        feeding = WhatIfTracker(TIERS)
        feeding.start()
        live.append(lookup_loop(requests, index, feeding, per_tier=False))
        fed.append(feeding.processed / (feeding.processed + feeding.pending))
        feeding.close()
    per_chunk = 1e6 / chunks
    return {
        "chunks_per_pass": chunks,
        "off_us_per_chunk": statistics.median(off) * per_chunk,
        "on_us_per_chunk": statistics.median(on) * per_chunk,
        "live_feeder_us_per_chunk": statistics.median(live) * per_chunk,
        "on_every_tier_us_per_chunk": statistics.median(one) * per_chunk,
        "on_off_ratio": statistics.median(on) / statistics.median(off),
        "on_every_tier_off_ratio": statistics.median(one) / statistics.median(off),
        "live_off_ratio": statistics.median(live) / statistics.median(off),
        "live_fed_fraction": statistics.median(fed),  # of the references, fed while the loop ran
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller inputs, for a smoke run")
    parser.add_argument("--out", type=Path, default=Path(".run/bench/whatif.json"))
    args = parser.parse_args()
    n, count, passes, rounds = (50_000, 100, 2, 3) if args.quick else (300_000, 400, 8, 5)
    record_us = bench_record(n)
    feeder_us, rates = bench_feeder(n)
    lookup = bench_lookup(count, passes, rounds)
    result = {"record_us": record_us, "feeder_us_per_ref": feeder_us, "sampling_rates": rates, **lookup}
    rows = [
        ("record (step loop), µs per call", f"{record_us:.3f}"),
        ("feeder, µs per processed reference", f"{feeder_us:.2f}"),
        ("sampling rate cpu / disk / remote", " / ".join(f"{r:.3f}" for r in rates.values())),
        ("lookup loop off, µs per chunk", f"{lookup['off_us_per_chunk']:.2f}"),
        ("lookup loop + record x3 tiers, µs per chunk", f"{lookup['on_us_per_chunk']:.2f}"),
        ("lookup loop + record(None) once, µs per chunk", f"{lookup['on_every_tier_us_per_chunk']:.2f}"),
        ("lookup loop + record(None), feeder thread live", f"{lookup['live_feeder_us_per_chunk']:.2f}"),
        ("on (x3 tiers) / off", f"{lookup['on_off_ratio']:.3f}"),
        ("on (record(None)) / off", f"{lookup['on_every_tier_off_ratio']:.3f}"),
        ("live feeder / off", f"{lookup['live_off_ratio']:.3f}"),
        ("fed while the loop ran (live feeder)", f"{lookup['live_fed_fraction']:.0%}"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
