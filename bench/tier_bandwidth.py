"""KVLens's tiers against plain copies of the same bytes, side by side in one process.

    python bench/tier_bandwidth.py [--quick] [--chunks 32] [--rounds 7]

The KV cache is laid out as vLLM 0.32 lays it out on CPU (one ``[blocks, heads, block_size,
2*head]`` bf16 tensor per layer; the default shape is the benchmark model's: 8 layers, 8 KV
heads of 128, 16-token blocks, 256-token chunks, so 4 MiB per chunk). Per round, for the same
chunks and bytes, every mode in turn:

* memcpy: one ``copy_`` per chunk of its whole bytes from distinct sources into distinct
  buffers that already exist (the fastest a copy of these bytes can be here: no page faults,
  and as many bytes as the tiers move, so no cache reuse either); memcpy-new: the same into new
  buffers that are kept, as a tier keeps what it stores (what any store must pay for new
  memory: page faults);
* cpu, cpu-in-step: the worker's store (gather every layer's blocks of a chunk and keep them)
  and load (scatter them back into the KV tensors), with layer-wise copies on and off;
* file: a plain sequential ``write`` of the chunk's bytes to a new file and ``readinto`` of it
  (the page cache included, as for the tier), against disk: the disk tier's ``put`` and ``get``;
* disk-load: the worker's load of the same chunks from its disk tier (records in the page cache,
  read a layer at a time straight into the KV tensors and checked there), against ``cpu``'s load.

Targets (issue 10): CPU load and store >= 0.8 x memcpy of the same bytes (stores: into new
memory); disk >= 0.8 x plain file I/O; a disk-tier load >= 0.95 x a CPU-tier load (issue 19:
a disk hit within 1.05x of a CPU-tier hit). Ratios are medians of per-round ratios (the machine is
shared and noisy).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib.runner import Benchmark, Figure, Option, Side, Target, each, main, timed  # noqa: E402
from connector.config.loading import load_config  # noqa: E402
from connector.engine.facts import EngineFacts  # noqa: E402
from connector.engine.jobs import CPU, DISK, ChunkLoad, Eviction, LoadJob, StepPlan, StoreJob  # noqa: E402
from connector.tiers.disk import DiskTier  # noqa: E402
from connector.worker.connector_worker import ConnectorWorker  # noqa: E402
from connector.worker.kv_blocks import BlockCopier  # noqa: E402

TARGET = 0.8
COMPARED_WITH = {
    "cpu": ("memcpy", "memcpy-new"),
    "cpu-in-step": ("memcpy", "memcpy-new"),
    "disk": ("file",),
    "disk-load": ("cpu",),
}
DISK_LOAD_TARGET = 0.95


def kv_caches(layers: int, blocks: int, heads: int, block_size: int, head: int) -> dict[str, torch.Tensor]:
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(blocks, heads, block_size, 2 * head).to(
            torch.bfloat16
        )
        for i in range(layers)
    }


def make_worker(
    caches, num_blocks: int, block_size: int, chunk_tokens: int, layerwise: bool, disk: str | None = None
) -> ConnectorWorker:
    copier = BlockCopier(caches, num_blocks)
    facts = EngineFacts(
        "m", "bf16", block_size, copier.num_layers, copier.block_bytes, "layout", 1, "kv_both"
    )
    cfg = {
        "lmcache.chunk_size": chunk_tokens,
        "lmcache.max_local_cpu_size": 64,
        "lmcache.use_layerwise": layerwise,
    }
    if disk is not None:  # the disk tier alone
        cfg |= {"lmcache.local_cpu": False, "lmcache.local_disk": disk, "lmcache.max_local_disk_size": 64}
    w = ConnectorWorker(load_config(cfg, env={}), facts, rank=0)
    w.register(caches, num_blocks)
    return w


class TierBandwidth(Benchmark):
    name = "tier_bandwidth"
    figures = (
        Figure("store_gbps", "store / write GB/s", "{:.2f}", ratio=True, panel="GB/s"),
        Figure("load_gbps", "load / read GB/s", "{:.2f}", ratio=True, panel="GB/s"),
    )
    baselines = ("memcpy", "memcpy-new", "file")
    targets = (
        Target(
            f"CPU load >= {TARGET} x memcpy",
            "load_gbps",
            TARGET,
            at_most=False,
            baseline="memcpy",
            mode_prefix="cpu",
        ),
        Target(
            f"CPU store >= {TARGET} x memcpy into new memory",
            "store_gbps",
            TARGET,
            at_most=False,
            baseline="memcpy-new",
            mode_prefix="cpu",
        ),
        Target(f"disk write >= {TARGET} x plain write", "store_gbps", TARGET, at_most=False, baseline="file"),
        Target(f"disk read >= {TARGET} x plain read", "load_gbps", TARGET, at_most=False, baseline="file"),
        Target(
            f"disk-tier load >= {DISK_LOAD_TARGET} x CPU-tier load",
            "load_gbps",
            DISK_LOAD_TARGET,
            at_most=False,
            baseline="cpu",
            mode_prefix="disk-load",
        ),
    )
    repeats = (7, 2)
    repeat_flags = ("--rounds",)
    options = {
        "chunks": Option(32, 4, "chunks per round"),
        "layers": Option(8, 2),
        "heads": Option(8, 2, "KV heads"),
        "head": Option(128, help="head size"),
        "block_size": Option(16),
        "chunk_tokens": Option(256),
    }

    def sides(self) -> list[Side]:
        return [Side(n) for n in ("memcpy", "memcpy-new", "cpu", "cpu-in-step", "file", "disk", "disk-load")]

    def compared_with(self, side: str) -> tuple[str, ...]:
        return COMPARED_WITH.get(side, ())

    @contextlib.contextmanager
    def setup(self) -> Iterator[None]:
        a = self.args
        torch.set_num_threads(1)  # the worker's one core, as in the serving benchmarks
        per_chunk = a.chunk_tokens // a.block_size
        num_blocks = per_chunk * a.chunks * 2
        caches = kv_caches(a.layers, num_blocks, a.heads, a.block_size, a.head)
        self.blocks = [tuple(range(i * per_chunk, (i + 1) * per_chunk)) for i in range(a.chunks)]
        self.targets_blocks = [
            tuple(range((a.chunks + i) * per_chunk, (a.chunks + i + 1) * per_chunk)) for i in range(a.chunks)
        ]
        self.names = [f"{i:032x}" for i in range(a.chunks)]
        tmp = tempfile.mkdtemp(prefix="kvlens-bw-")
        self.workers = {
            "cpu": make_worker(caches, num_blocks, a.block_size, a.chunk_tokens, True),
            "cpu-in-step": make_worker(caches, num_blocks, a.block_size, a.chunk_tokens, False),
            "disk-load": make_worker(
                caches, num_blocks, a.block_size, a.chunk_tokens, True, os.path.join(tmp, "worker-disk")
            ),
        }
        copier = self.workers["cpu"].copier
        self.chunk_bytes = copier.payload_nbytes(per_chunk)
        self.total = self.chunk_bytes * a.chunks
        self.sources = [copier.gather(b) for b in self.blocks]
        self.warm = [torch.ones_like(s) for s in self.sources]  # touched: no page faults
        self.payloads = [memoryview(s.numpy()).cast("B") for s in self.sources]
        disk_worker = self.workers["disk-load"]  # its records, written once (the loads read them)
        disk_worker.save(StepPlan(writes=self._writes(DISK)))
        disk_worker.flush()
        self.disk = DiskTier(os.path.join(tmp, "tier"), "layout", grace_s=0)
        self.plain_dir = os.path.join(tmp, "plain")
        os.makedirs(self.plain_dir)
        try:
            yield
        finally:
            for w in self.workers.values():
                w.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)

    def measure(self, side: Side, case: Any, rep: int) -> dict[str, float]:
        name, gbps = side.name, lambda seconds: self.total / seconds / 1e9
        if name == "memcpy":  # distinct sources into distinct, touched destinations: no cache reuse
            t = timed(lambda: each(lambda ds: ds[0].copy_(ds[1]), zip(self.warm, self.sources, strict=True)))
            return {"store_gbps": gbps(t), "load_gbps": gbps(t)}
        if name == "memcpy-new":  # kept, as a tier keeps what it stores: new pages every time
            return {"store_gbps": gbps(timed(lambda: [torch.empty_like(s).copy_(s) for s in self.sources]))}
        if name == "file":
            return {"store_gbps": gbps(timed(self._plain_write)), "load_gbps": gbps(timed(self._plain_read))}
        if name == "disk":
            put = timed(
                lambda: each(lambda np: self.disk.put(*np), zip(self.names, self.payloads, strict=True))
            )
            return {
                "store_gbps": gbps(put),
                "load_gbps": gbps(timed(lambda: each(self.disk.get, self.names))),
            }
        w = self.workers[name]
        tier = DISK if name == "disk-load" else CPU
        loads = [
            ChunkLoad(n, tier, t, 0, self.args.chunk_tokens)
            for n, t in zip(self.names, self.targets_blocks, strict=True)
        ]
        if tier == DISK:
            load = timed(lambda: w.load(StepPlan(loads=[LoadJob("r", tuple(loads))])))
            assert not w.take_failed_blocks()
            w.take_report()
            return {"load_gbps": gbps(load)}
        store = timed(lambda: w.save(StepPlan(writes=self._writes(CPU))))
        load = timed(lambda: w.load(StepPlan(loads=[LoadJob("r", tuple(loads))])))
        assert not w.take_failed_blocks()
        w.save(StepPlan(writes=[Eviction(CPU, n) for n in self.names]))
        return {"store_gbps": gbps(store), "load_gbps": gbps(load)}

    def _writes(self, tier: str) -> list[StoreJob]:
        return [
            StoreJob("r", n, b, (tier,), self.args.chunk_tokens)
            for n, b in zip(self.names, self.blocks, strict=True)
        ]

    def _plain_write(self) -> None:
        for i, p in enumerate(self.payloads):
            with open(os.path.join(self.plain_dir, f"{i}.bin"), "wb") as f:
                f.write(p)

    def _plain_read(self) -> None:
        for i in range(self.args.chunks):
            with open(os.path.join(self.plain_dir, f"{i}.bin"), "rb") as f:
                f.readinto(bytearray(os.fstat(f.fileno()).st_size))

    def workload(self) -> dict[str, Any]:
        return {"chunk_bytes": self.chunk_bytes, "bytes_per_round": self.total}


if __name__ == "__main__":
    sys.exit(main(TierBandwidth))
