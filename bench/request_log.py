"""What the request log costs per finished request, on the thread that finishes requests.

    python bench/request_log.py [--n 20000]

Side by side in one process: building a record and appending it (one ``O_APPEND`` write of
one JSON line, rotation included) with the log on; the same call with the log off (the one
flag check the scheduler makes); and a sampled log at rate 0.1 (the hash decides, most
requests write nothing). Reported in microseconds per request, median of 5 rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from telemetry.request_log import RequestLog, request_record  # noqa: E402


def one(log: RequestLog | None, i: int) -> None:
    if log is None or not log.wants(f"cmpl-{i}"):
        return
    log.append(
        request_record(
            request_id=f"cmpl-{i}",
            engine="0",
            model="bench",
            prompt_tokens=3000,
            vllm_cached_tokens=0,
            kvlens_tokens_by_tier={"cpu": 2816},
            lookup_ms=0.4,
            miss_reason="partial_chunk",
            load_ms=12.5,
            stored_chunks=0,
            trace_id="4bf92f3577b34da6a3ce929d0e0e4736",
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20000)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvlens-reqlog-"))
    modes = {
        "off": None,
        "on": RequestLog(str(tmp / "all.jsonl")),
        "sampled 0.1": RequestLog(str(tmp / "some.jsonl"), sample=0.1),
    }
    results: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(5):
        for mode, log in modes.items():
            start = time.perf_counter()
            for i in range(args.n):
                one(log, i)
            results[mode].append((time.perf_counter() - start) / args.n * 1e6)
    for mode, times in results.items():
        print(f"{mode:12s} {statistics.median(times):8.2f} us per finished request")


if __name__ == "__main__":
    main()
