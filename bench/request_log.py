"""What the request log costs per finished request, on the thread that finishes requests.

    python bench/request_log.py [--quick] [--n 20000] [--repeats 5]

Side by side in one process: building a record and appending it (one ``O_APPEND`` write of
one JSON line, rotation included) with the log on; the same call with the log off (the one
flag check the scheduler makes); and a sampled log at rate 0.1 (the hash decides, most
requests write nothing). Reported in microseconds per request, median over repetitions.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib.runner import Benchmark, Figure, Option, Side, main  # noqa: E402
from telemetry.request_log import RequestLog, request_record  # noqa: E402


def finish(log: RequestLog | None, i: int) -> None:
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


class RequestLogCost(Benchmark):
    name = "request_log"
    figures = (Figure("us_per_request", "µs per finished request", "{:.2f}", ratio=True, log=True),)
    baselines = ("off",)
    repeats = (5, 2)
    options = {"n": Option(20000, 2000, "finished requests per repetition")}

    def sides(self) -> list[Side]:
        return [Side("off", "log off"), Side("on", "every request"), Side("sampled", "sample rate 0.1")]

    @contextlib.contextmanager
    def setup(self) -> Iterator[None]:
        tmp = Path(tempfile.mkdtemp(prefix="kvlens-reqlog-"))
        self.logs = {"off": None, "on": RequestLog(str(tmp / "all.jsonl"))}
        self.logs["sampled"] = RequestLog(str(tmp / "some.jsonl"), sample=0.1)
        try:
            yield
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def measure(self, side: Side, case: Any, rep: int) -> dict[str, float]:
        log, n = self.logs[side.name], self.args.n
        start = time.perf_counter()
        for i in range(n):
            finish(log, i)
        return {"us_per_request": (time.perf_counter() - start) / n * 1e6}


if __name__ == "__main__":
    sys.exit(main(RequestLogCost))
