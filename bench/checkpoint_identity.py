"""What the model identity costs at start-up, against reading the whole checkpoint.

    python bench/checkpoint_identity.py [--quick] [--gb 16] [--dir DIR] [--keep] [--skip-full] [--repeat 3]

Builds a checkpoint shaped like Llama-3-8B in bf16 (4 safetensors shards, 291 tensors,
16 GB by default; values are random bytes), then times, side by side on the same files,
KVLens's content fingerprint (``connector.checkpoint_identity.fingerprint``) and a plain hash
of every byte (what "fingerprint the checkpoint" would cost without sampling): warm (files in
the page cache) and cold (pages dropped with ``posix_fadvise(DONTNEED)`` before each run).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib.runner import Benchmark, Case, Figure, Option, Side, main  # noqa: E402
from connector.checkpoint_identity import fingerprint  # noqa: E402

HIDDEN, INTER, LAYERS, VOCAB, KV = 4096, 14336, 32, 128256, 1024
SHARDS = 4


def llama_tensors(scale: float) -> list[tuple[str, tuple[int, ...]]]:
    shapes = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            (p + "self_attn.k_proj.weight", (KV, HIDDEN)),
            (p + "self_attn.v_proj.weight", (KV, HIDDEN)),
            (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            (p + "mlp.gate_proj.weight", (INTER, HIDDEN)),
            (p + "mlp.up_proj.weight", (INTER, HIDDEN)),
            (p + "mlp.down_proj.weight", (HIDDEN, INTER)),
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "post_attention_layernorm.weight", (HIDDEN,)),
        ]
    shapes += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    out = []
    for name, shape in shapes:  # scale the big dimension so the total is --gb
        if len(shape) == 2 and scale != 1.0:
            shape = (max(int(shape[0] * scale), 1), shape[1])
        out.append((name, shape))
    return out


def write_checkpoint(folder: Path, gb: float, shards: int = 4) -> int:
    full = sum(2 * _numel(s) for _, s in llama_tensors(1.0))
    tensors = llama_tensors(gb * 1e9 / full)
    per_shard = -(-len(tensors) // shards)
    block = os.urandom(64 << 20)
    total = 0
    for k in range(shards):
        part = tensors[k * per_shard : (k + 1) * per_shard]
        header, offset = {}, 0
        for name, shape in part:
            n = 2 * _numel(shape)
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(folder / f"model-{k + 1:05d}-of-{shards:05d}.safetensors", "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            left = offset
            while left:
                n = min(left, len(block))
                f.write(block[:n])
                left -= n
        total += offset + 8 + len(raw)
    return total


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def drop_cache(folder: Path) -> None:
    for p in folder.iterdir():
        with open(p, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def full_hash(folder: Path) -> str:
    h = hashlib.blake2b(digest_size=8)
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    for p in sorted(folder.iterdir()):
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(view[:n])
    return h.hexdigest()


def fingerprint_of(folder: Path) -> None:
    fingerprint(str(folder))


class CheckpointIdentity(Benchmark):
    name = "checkpoint_identity"
    figures = (Figure("ms", "ms", "{:.1f}", ratio=True, log=True),)
    baselines = ("full-read",)
    case_label = "page cache"
    repeat_flags = ("--repeat",)
    options = {
        "gb": Option(16.0, 0.2, "checkpoint size"),
        "dir": Option(None, help="where to build it (default: a temporary folder)"),
        "keep": Option(False, help="keep the checkpoint"),
        "skip_full": Option(False, help="do not time the full read"),
    }

    def sides(self) -> list[Side]:
        full = [] if self.args.skip_full else [Side("full-read", "hash of every byte")]
        return [Side("fingerprint", "KVLens's content fingerprint"), *full]

    def cases(self) -> list[Case]:
        return [Case("warm", False), Case("cold", True)]

    @contextlib.contextmanager
    def setup(self) -> Iterator[None]:
        self.folder = Path(self.args.dir or tempfile.mkdtemp(prefix="kvlens-ckpt-"))
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            started = time.perf_counter()
            self.size = write_checkpoint(self.folder, self.args.gb, SHARDS)
            os.sync()  # dirty pages cannot be dropped
            found = fingerprint(str(self.folder))
            self.read_bytes, self.total_bytes = found.read_bytes, found.total_bytes
            print(
                f"   checkpoint: {self.size / 1e9:.1f} GB in {SHARDS} shards, written in "
                f"{time.perf_counter() - started:.0f}"
                f" s; the fingerprint reads {self.read_bytes / 1e3:.1f} KB",
                flush=True,
            )
            yield
        finally:
            if not self.args.keep:
                shutil.rmtree(self.folder, ignore_errors=True)

    def measure(self, side: Side, case: Case, rep: int) -> dict[str, float]:
        if case.params:
            drop_cache(self.folder)
        started = time.perf_counter()
        (fingerprint_of if side.name == "fingerprint" else full_hash)(self.folder)
        return {"ms": (time.perf_counter() - started) * 1e3}

    def workload(self) -> dict[str, Any]:
        return {
            "checkpoint_bytes": self.size,
            "shards": SHARDS,
            "fingerprint_read_bytes": self.read_bytes,
            "fingerprint_total_bytes": self.total_bytes,
        }


if __name__ == "__main__":
    sys.exit(main(CheckpointIdentity))
