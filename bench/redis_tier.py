"""What the remote tier costs next to the CPU and disk tiers: put/get throughput of 4 MB chunks
and lookup round trips, in one run.

    .venv/bin/python bench/redis_tier.py [--quick] [--url redis://host:port/0] [--rounds 5]

Without --url a private redis-server is started on a free loopback port (no persistence) and
stopped at the end. Side by side, on the same payloads, in turns: a plain in-process ``bytes``
copy (the ceiling any tier is measured against; the CPU tier is exactly this: it keeps the
buffer the worker gathered from vLLM's blocks, with no copy of its own), the disk tier (a
temporary directory, so the page cache is warm: what a recently written chunk costs), then
``RedisTier.put``/``get`` one chunk per call (redis, which also times ``exists_many`` for 16 and
128 names, half present: the call a lookup makes) and ``put_many``/``get_many`` in batches
(redis-batched). Throughput in GB/s of payload, times in milliseconds, medians over rounds.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis  # noqa: E402

from bench.lib.runner import Benchmark, Figure, Option, Side, each, main  # noqa: E402
from bench.lib.servers import RedisServer  # noqa: E402
from connector.tiers.disk import DiskTier  # noqa: E402
from connector.tiers.redis_tier import RedisTier  # noqa: E402
from connector.tiers.remote_url import parse_remote_url  # noqa: E402

MB = 1024 * 1024
LOOKUP_PANEL = "lookup round trips (redis)"


def median_ms(fn: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


class RedisTierCost(Benchmark):
    name = "redis_tier"
    figures = (
        Figure("put_gbps", "put GB/s", "{:.2f}", ratio=True, panel="GB/s"),
        Figure("get_gbps", "get GB/s", "{:.2f}", ratio=True, panel="GB/s"),
        Figure("exists_many_16_ms", "exists_many(16) ms", panel=LOOKUP_PANEL),
        Figure("exists_many_128_ms", "exists_many(128) ms", panel=LOOKUP_PANEL),
        Figure("ping_ms", "ping ms", panel=LOOKUP_PANEL),
    )
    baselines = ("copy",)
    repeats = (5, 2)
    repeat_flags = ("--rounds",)
    options = {
        "url": Option(
            None, help="benchmark this server instead of starting one (its prefix kvlens-bench is cleared)"
        ),
        "chunks": Option(32, 8, "payloads per round"),
        "chunk_mb": Option(4),
        "batch": Option(8, help="items per put_many/get_many call"),
        "lookups": Option(200, 20, "calls per lookup figure"),
    }

    def sides(self) -> list[Side]:
        return [
            Side("copy", "bytes copy (in process)"),
            Side("disk", "disk tier"),
            Side("redis", "one chunk per call"),
            Side("redis-batched", "put_many/get_many"),
        ]

    @contextlib.contextmanager
    def setup(self) -> Iterator[None]:
        a = self.args
        self.payloads = [memoryview(bytearray(os.urandom(a.chunk_mb * MB))) for _ in range(a.chunks)]
        self.total = sum(p.nbytes for p in self.payloads)
        self.names = [f"{i:032x}.r0" for i in range(a.chunks)]
        with contextlib.ExitStack() as stack:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvlens-bench-")))
            if a.url:
                self.url = a.url
            else:
                server = RedisServer(tmp / "redis")
                server.start()
                stack.callback(server.stop)
                self.url = server.url
            self.tier = RedisTier(
                parse_remote_url(self.url), "bench-layout", key_prefix="kvlens-bench", timeout_s=5.0
            )
            self.tier.clear()
            stack.callback(self.tier.close)
            stack.callback(self.tier.clear)
            self.disk = DiskTier(str(tmp / "disk"), "bench-layout")
            with redis.Redis.from_url(self.url) as client:
                self.server_version = client.info("server").get("redis_version")
            yield

    def measure(self, side: Side, case: Any, rep: int) -> dict[str, float]:
        pairs = list(zip(self.names, self.payloads, strict=True))
        if side.name == "copy":  # each copy dropped at once: the next reuses its memory
            copy = self._gbps(lambda: all(bytes(p) for p in self.payloads))
            return {"put_gbps": copy, "get_gbps": copy}
        if side.name == "redis-batched":
            starts = range(0, len(pairs), self.args.batch)
            put = self._gbps(lambda: each(lambda i: self._put_batch(pairs[i : i + self.args.batch]), starts))
            get = self._gbps(
                lambda: each(lambda i: self._get_batch(self.names[i : i + self.args.batch]), starts)
            )
            return {"put_gbps": put, "get_gbps": get}
        tier = self.disk if side.name == "disk" else self.tier
        rec = {"put_gbps": self._gbps(lambda: each(lambda np: tier.put(*np), pairs))}
        rec["get_gbps"] = self._gbps(lambda: each(tier.get, self.names))
        assert bytes(tier.get(self.names[0])) == bytes(self.payloads[0])
        return rec | (self._lookups() if side.name == "redis" else {})

    def _gbps(self, fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return self.total / (time.perf_counter() - start) / 1e9

    def _put_batch(self, items: list) -> None:
        assert not any(self.tier.put_many(items))

    def _get_batch(self, names: list[str]) -> None:
        assert all(isinstance(g, memoryview) for g in self.tier.get_many(names))

    def _lookups(self) -> dict[str, float]:
        """``exists_many`` for 16 and 128 names (half of them present) and ``ping``."""
        present = [f"{i:032x}.p0" for i in range(0, 128, 2)]
        self.tier.put_many([(n, memoryview(b"x" * 64)) for n in present])
        out = {}
        for count in (16, 128):
            asked = [f"{i:032x}.p0" for i in range(count)]
            out[f"exists_many_{count}_ms"] = median_ms(
                lambda a=asked: self.tier.exists_many(a), self.args.lookups
            )
        out["ping_ms"] = median_ms(self.tier.ping, self.args.lookups)
        return out

    def workload(self) -> dict[str, Any]:
        return {
            "url": parse_remote_url(self.url).redacted(),
            "server_version": self.server_version,
            "redis_py": redis.__version__,
            "hiredis": importlib.util.find_spec("hiredis") is not None,
            "chunk_mb": self.args.chunk_mb,
            "chunks": self.args.chunks,
        }


if __name__ == "__main__":
    sys.exit(main(RedisTierCost))
