"""What the model identity costs at start-up, against reading the whole checkpoint.

Builds a checkpoint shaped like Llama-3-8B in bf16 (4 safetensors shards, 291 tensors,
16 GB by default; values are random bytes), then times, side by side on the same files,
KVLens's content fingerprint (``connector.checkpoint_identity.fingerprint``) and a plain hash
of every byte (what "fingerprint the checkpoint" would cost without sampling): warm (files in
the page cache) and cold (pages dropped with ``posix_fadvise(DONTNEED)`` before each run).

    python bench/checkpoint_identity.py [--gb 16] [--dir DIR] [--keep] [--skip-full]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from connector.checkpoint_identity import fingerprint  # noqa: E402

HIDDEN, INTER, LAYERS, VOCAB, KV = 4096, 14336, 32, 128256, 1024


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


def timed(fn, folder: Path, cold: bool) -> float:
    if cold:
        drop_cache(folder)
    started = time.perf_counter()
    fn(folder)
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=16.0)
    ap.add_argument("--dir", help="where to build it (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint")
    ap.add_argument("--skip-full", action="store_true", help="do not time the full read")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    folder = Path(args.dir or tempfile.mkdtemp(prefix="kvlens-ckpt-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        started = time.perf_counter()
        size = write_checkpoint(folder, args.gb)
        os.sync()  # dirty pages cannot be dropped
        took = time.perf_counter() - started
        print(f"checkpoint: {size / 1e9:.1f} GB in 4 shards, 291 tensors (written in {took:.0f} s)")
        found = fingerprint(str(folder))
        print(f"fingerprint reads {found.read_bytes / 1e3:.1f} KB of {found.total_bytes / 1e9:.1f} GB")
        rows = []
        for cold in (False, True):
            fp = sorted(timed(fingerprint_of, folder, cold) for _ in range(args.repeat))
            full = (
                None if args.skip_full else sorted(timed(full_hash, folder, cold) for _ in range(args.repeat))
            )
            rows.append((cold, fp[len(fp) // 2], full[len(full) // 2] if full else None))
        print("| page cache | fingerprint | full read | fingerprint / full read |")
        print("|---|---|---|---|")
        for cold, fp, full in rows:
            ratio = f"{fp / full:.5f}" if full else "-"
            full_s = f"{full:.2f} s" if full else "-"
            print(f"| {'cold' if cold else 'warm'} | {fp * 1000:.1f} ms | {full_s} | {ratio} |")
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


def fingerprint_of(folder: Path) -> None:
    fingerprint(str(folder))


if __name__ == "__main__":
    main()
