"""What the remote tier costs next to the CPU and disk tiers: put/get throughput of 4 MB chunks
and lookup round trips, in one run.

    .venv/bin/python bench/redis_tier.py [--quick] [--out results.json] [--url redis://host:port/0]

Without --url a private redis-server is started on a free loopback port (no persistence) and
stopped at the end. Side by side, on the same payloads: a plain in-process ``bytes`` copy (the
ceiling any tier is measured against; the CPU tier is exactly this: it keeps the buffer the
worker gathered from vLLM's blocks, with no copy of its own), the disk tier (a temporary
directory, so the page cache is warm: what a recently written chunk costs), then ``RedisTier.put``/``get`` one
chunk per call, ``put_many``/``get_many`` in batches, and ``exists_many`` for 16 and 128 names
(half present), the call a lookup makes. Throughput is the median over rounds, in GB/s of payload;
times are medians in milliseconds. --quick runs in a few seconds (CI keeps the script working).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis  # noqa: E402

from connector.tiers.disk import DiskTier  # noqa: E402
from connector.tiers.redis_tier import RedisTier  # noqa: E402
from connector.tiers.remote_url import parse_remote_url  # noqa: E402

MB = 1024 * 1024


@contextmanager
def private_server() -> Iterator[str]:
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server is not installed (bash scripts/setup.sh), or pass --url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as workdir:
        cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        cmd += ["--dir", workdir, "--logfile", os.path.join(workdir, "redis.log")]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        try:
            client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1)
            for _ in range(200):
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.02)
            client.close()
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def median_time(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(url: str, chunks: int, chunk_mb: int, batch: int, rounds: int, lookups: int) -> dict[str, object]:
    payloads = [memoryview(bytearray(os.urandom(chunk_mb * MB))) for _ in range(chunks)]
    total = sum(p.nbytes for p in payloads)
    names = [f"{i:032x}.r0" for i in range(chunks)]
    tier = RedisTier(parse_remote_url(url), "bench-layout", key_prefix="kvlens-bench", timeout_s=5.0)
    tier.clear()
    gbps = {}

    def copy_all() -> None:
        for p in payloads:
            bytes(p)

    def put_each() -> None:
        for n, p in zip(names, payloads, strict=True):
            tier.put(n, p)

    def get_each() -> None:
        for n in names:
            tier.get(n)

    def put_batches() -> None:
        for i in range(0, chunks, batch):
            assert not any(
                tier.put_many(list(zip(names[i : i + batch], payloads[i : i + batch], strict=True)))
            )

    def get_batches() -> None:
        for i in range(0, chunks, batch):
            assert all(isinstance(g, memoryview) for g in tier.get_many(names[i : i + batch]))

    disk_dir = tempfile.TemporaryDirectory(prefix="kvlens-bench-disk-")
    disk = DiskTier(disk_dir.name, "bench-layout")

    def tier_put(t: object) -> Callable[[], None]:
        return lambda: [t.put(n, p) for n, p in zip(names, payloads, strict=True)]  # type: ignore[attr-defined]

    def tier_get(t: object) -> Callable[[], None]:
        return lambda: [t.get(n) for n in names]  # type: ignore[attr-defined]

    steps = [
        ("bytes copy (in process)", copy_all),
        ("disk tier put", tier_put(disk)),
        ("disk tier get", tier_get(disk)),
        ("put, one per call", put_each),
        ("get, one per call", get_each),
        (f"put_many, {batch} per call", put_batches),
        (f"get_many, {batch} per call", get_batches),
    ]
    for label, fn in steps:
        gbps[label] = total / median_time(fn, rounds) / 1e9
    assert bytes(tier.get(names[0])) == bytes(payloads[0])
    assert bytes(disk.get(names[0])) == bytes(payloads[0])
    disk_dir.cleanup()

    lookup_ms = {}
    tier.clear()
    present = [f"{i:032x}.r0" for i in range(0, 128, 2)]
    tier.put_many([(n, memoryview(b"x" * 64)) for n in present])
    for count in (16, 128):
        asked = [f"{i:032x}.r0" for i in range(count)]
        lookup_ms[f"exists_many({count})"] = median_time(lambda a=asked: tier.exists_many(a), lookups) * 1e3
    lookup_ms["ping"] = median_time(tier.ping, lookups) * 1e3
    tier.clear()
    tier.close()
    with redis.Redis.from_url(url) as client:
        server = client.info("server").get("redis_version")
    return {
        "url": parse_remote_url(url).redacted(),
        "server_version": server,
        "redis_py": redis.__version__,
        "hiredis": importlib.util.find_spec("hiredis") is not None,
        "chunk_mb": chunk_mb,
        "chunks": chunks,
        "rounds": rounds,
        "throughput_gbps": gbps,
        "latency_ms": lookup_ms,
    }


def print_table(result: dict[str, object]) -> None:
    print(
        f"\nremote tier on {result['url']} (server {result['server_version']}, "
        f"redis-py {result['redis_py']}, "
        f"hiredis {'yes' if result['hiredis'] else 'no'}): {result['chunks']} x {result['chunk_mb']} MB, "
        f"median of {result['rounds']} rounds"
    )
    gbps: dict[str, float] = result["throughput_gbps"]  # type: ignore[assignment]
    ceiling = gbps["bytes copy (in process)"]
    print(f"  {'operation':<28}{'GB/s':>8}{'x copy':>9}")
    for label, value in gbps.items():
        print(f"  {label:<28}{value:>8.2f}{value / ceiling:>9.2f}")
    latency: dict[str, float] = result["latency_ms"]  # type: ignore[assignment]
    print(f"  {'lookup':<28}{'ms':>8}")
    for label, value in latency.items():
        print(f"  {label:<28}{value:>8.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--url", help="benchmark this server instead of starting one (its prefix kvlens-bench is cleared)"
    )
    ap.add_argument("--chunks", type=int, default=32, help="payloads per round (default 32)")
    ap.add_argument("--chunk-mb", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8, help="items per put_many/get_many call")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a few seconds: 8 chunks, 2 rounds")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    if args.quick:
        args.chunks, args.rounds = 8, 2
    lookups = 20 if args.quick else 200
    if args.url:
        result = run(args.url, args.chunks, args.chunk_mb, args.batch, args.rounds, lookups)
    else:
        with private_server() as url:
            result = run(url, args.chunks, args.chunk_mb, args.batch, args.rounds, lookups)
    print_table(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
