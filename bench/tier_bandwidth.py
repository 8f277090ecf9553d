"""KVLens's tiers against plain copies of the same bytes, side by side in one process.

    python bench/tier_bandwidth.py [--quick] [--chunks 32] [--out DIR]

The KV cache is laid out as vLLM 0.32 lays it out on CPU (one ``[blocks, heads, block_size,
2*head]`` bf16 tensor per layer; the default shape is the benchmark model's: 8 layers, 8 KV
heads of 128, 16-token blocks, 256-token chunks, so 4 MiB per chunk). Per round, for the same
chunks and bytes:

* memcpy: one ``copy_`` per chunk of its whole bytes from distinct sources into distinct
  buffers that already exist (the fastest a copy of these bytes can be here: no page faults,
  and as many bytes as the tiers move, so no cache reuse either) and into new buffers that are
  kept, as a tier keeps what it stores (what any store must pay for new memory: page faults);
* CPU tier: the worker's store (gather every layer's blocks of a chunk and keep them) and load
  (scatter them back into the KV tensors), with layer-wise copies on and off;
* disk: a plain sequential ``write`` of the chunk's bytes to a new file and ``readinto`` of it
  (the page cache included, as for the tier), against the disk tier's ``put`` and ``get``.

Targets (issue 10): CPU load and store >= 0.8 x memcpy of the same bytes; disk >= 0.8 x plain
file I/O. Ratios are medians of per-round ratios (the machine is shared and noisy).
Writes tier_bandwidth.json (see --out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from connector.config import load_config  # noqa: E402
from connector.engine.facts import EngineFacts  # noqa: E402
from connector.engine.jobs import CPU, ChunkLoad, Eviction, LoadJob, StepPlan, StoreJob  # noqa: E402
from connector.kv_blocks import BlockCopier  # noqa: E402
from connector.tiers.disk import DiskTier  # noqa: E402
from connector.worker import ConnectorWorker  # noqa: E402

TARGET = 0.8


def kv_caches(layers: int, blocks: int, heads: int, block_size: int, head: int) -> dict[str, torch.Tensor]:
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(blocks, heads, block_size, 2 * head).to(
            torch.bfloat16
        )
        for i in range(layers)
    }


def make_worker(caches, num_blocks, block_size, chunk_tokens, layerwise, disk_dir=None) -> ConnectorWorker:
    copier = BlockCopier(caches, num_blocks)
    facts = EngineFacts(
        "m", "bf16", block_size, copier.num_layers, copier.block_bytes, "layout", 1, "kv_both"
    )
    cfg = {
        "lmcache.chunk_size": chunk_tokens,
        "lmcache.max_local_cpu_size": 64,
        "lmcache.use_layerwise": layerwise,
    }
    if disk_dir:
        cfg.update(
            {"lmcache.local_cpu": False, "lmcache.local_disk": disk_dir, "lmcache.max_local_disk_size": 64}
        )
    w = ConnectorWorker(load_config(cfg, env={}), facts, rank=0)
    w.register(caches, num_blocks)
    return w


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def run(args: argparse.Namespace) -> dict[str, object]:
    per_chunk = args.chunk_tokens // args.block_size
    num_blocks = per_chunk * args.chunks * 2
    caches = kv_caches(args.layers, num_blocks, args.heads, args.block_size, args.head)
    chunk_blocks = [tuple(range(i * per_chunk, (i + 1) * per_chunk)) for i in range(args.chunks)]
    targets = [
        tuple(range((args.chunks + i) * per_chunk, (args.chunks + i + 1) * per_chunk))
        for i in range(args.chunks)
    ]
    names = [f"{i:032x}" for i in range(args.chunks)]
    tmp = tempfile.mkdtemp(prefix="kvlens-bw-")
    workers = {
        "cpu": make_worker(caches, num_blocks, args.block_size, args.chunk_tokens, True),
        "cpu-in-step": make_worker(caches, num_blocks, args.block_size, args.chunk_tokens, False),
    }
    copier = workers["cpu"].copier
    chunk_bytes = copier.payload_nbytes(per_chunk)
    total = chunk_bytes * args.chunks
    src = copier.gather(chunk_blocks[0])
    sources = [copier.gather(b) for b in chunk_blocks]
    warm = [torch.ones_like(src) for _ in chunk_blocks]  # touched: no page faults
    disk = DiskTier(os.path.join(tmp, "tier"), "layout", grace_s=0)
    plain_dir = os.path.join(tmp, "plain")
    os.makedirs(plain_dir)
    payloads = [memoryview(copier.gather(b).numpy()).cast("B") for b in chunk_blocks]

    def memcpy_warm():  # distinct sources into distinct, touched destinations: no cache reuse
        for dst, s in zip(warm, sources, strict=True):
            dst.copy_(s)

    def memcpy_fresh():  # kept, as a tier keeps what it stores: new pages every time
        kept = [torch.empty_like(src).copy_(src) for _ in range(args.chunks)]
        return kept

    def store(w):
        def go():
            w.save(
                StepPlan(
                    writes=[
                        StoreJob("r", n, b, (CPU,), args.chunk_tokens)
                        for n, b in zip(names, chunk_blocks, strict=True)
                    ]
                )
            )

        return go

    def load(w):
        def go():
            job = LoadJob(
                "r",
                tuple(
                    ChunkLoad(n, CPU, t, 0, args.chunk_tokens) for n, t in zip(names, targets, strict=True)
                ),
            )
            w.load(StepPlan(loads=[job]))

        return go

    def evict(w):
        w.save(StepPlan(writes=[Eviction(CPU, n) for n in names]))

    def plain_write():
        for i, p in enumerate(payloads):
            with open(os.path.join(plain_dir, f"{i}.bin"), "wb") as f:
                f.write(p)

    def plain_read():
        for i in range(args.chunks):
            path = os.path.join(plain_dir, f"{i}.bin")
            with open(path, "rb") as f:
                buf = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(buf)

    def disk_put():
        for n, p in zip(names, payloads, strict=True):
            disk.put(n, p)

    def disk_get():
        for n in names:
            disk.get(n)

    rounds: list[dict[str, float]] = []
    for _ in range(args.rounds):
        r = {"memcpy_warm": timed(memcpy_warm), "memcpy_fresh": timed(memcpy_fresh)}
        for label, w in workers.items():
            r[f"store_{label}"] = timed(store(w))
            r[f"load_{label}"] = timed(load(w))
            assert not w.take_failed_blocks()
            evict(w)
        r["plain_write"] = timed(plain_write)
        r["disk_put"] = timed(disk_put)
        r["plain_read"] = timed(plain_read)
        r["disk_get"] = timed(disk_get)
        rounds.append(r)
    for w in workers.values():
        w.shutdown()
    for f in Path(tmp).rglob("*"):
        if f.is_file():
            f.unlink()

    def gbps(key: str) -> float:
        return total / statistics.median(r[key] for r in rounds) / 1e9

    def ratio(key: str, base: str) -> float:
        return statistics.median(r[base] / r[key] for r in rounds)  # bandwidth of key / of base

    ratios = {
        "cpu_load_vs_memcpy": ratio("load_cpu", "memcpy_warm"),
        "cpu_load_in_step_vs_memcpy": ratio("load_cpu-in-step", "memcpy_warm"),
        "cpu_store_vs_memcpy_fresh": ratio("store_cpu", "memcpy_fresh"),
        "cpu_store_in_step_vs_memcpy_fresh": ratio("store_cpu-in-step", "memcpy_fresh"),
        "cpu_store_vs_memcpy_warm": ratio("store_cpu", "memcpy_warm"),
        "disk_put_vs_plain_write": ratio("disk_put", "plain_write"),
        "disk_get_vs_plain_read": ratio("disk_get", "plain_read"),
    }
    return {
        "settings": vars(args) | {"chunk_bytes": chunk_bytes, "bytes_per_round": total},
        "gb_per_s": {k: gbps(k) for k in rounds[0]},
        "ratios": ratios,
        "target": TARGET,
        "rounds": rounds,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a few seconds: CI keeps the script working")
    p.add_argument("--chunks", type=int, default=32)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / ".run" / "bench" / "results"))
    args = p.parse_args(argv)
    if args.quick:
        args.chunks, args.rounds, args.layers, args.heads = 4, 2, 2, 2
    torch.set_num_threads(1)  # the worker's one core, as in the serving benchmarks
    out = Path(args.out)
    result = run(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tier_bandwidth.json").write_text(json.dumps(result, indent=1))
    print(f"{'what':<22} {'GB/s':>7}")
    for key, value in result["gb_per_s"].items():
        print(f"{key:<22} {value:>7.2f}")
    print(f"\n{'ratio (bandwidth)':<36} {'value':>6}  target >= {TARGET}")
    for key, value in result["ratios"].items():
        flag = "" if "warm" in key or value >= TARGET else "  (missed)"
        print(f"{key:<36} {value:>6.2f}{flag}")


if __name__ == "__main__":
    main()
