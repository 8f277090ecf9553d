"""What the model identity costs at start-up, against vLLM's own read of the same weights.

    python bench/checkpoint_identity.py [--quick] [--gb 16] [--dir DIR] [--keep] [--skip-vllm] [--repeat 3]
        [--modes identity,identity-cached,vllm-read,vllm-read+hash]

Builds a checkpoint shaped like Llama-3-8B in bf16 (4 safetensors shards, 291 tensors,
16 GB by default; values are random bytes), then times, side by side on the same files:
KVLens's identity (``connector.checkpoint_identity.fingerprint``: every byte hashed, xxh3-128,
up to 8 threads) with no digest remembered, the same with every file's digest remembered (a restart:
stats only), and vLLM's own read of the weights (``safetensors_weights_iterator``, every tensor
copied into a new tensor and dropped: vLLM's load on a CPU, without building the model;
a GPU adds the copy to the device); warm (files in the page cache, as vLLM leaves them when KVLens starts) and
cold (pages dropped with ``posix_fadvise(DONTNEED)`` before each run).

``vllm-read+hash``: the same read of vLLM's, with KVLens's vLLM plugin hashing the files beside
it (``connector.vllm_plugin.weights_hook.read_beside``, the code the plugin wraps vLLM's
iterator in; nothing remembered before), what a load with KVLens costs now that the scheduler
half finds the digests remembered: its time over ``vllm-read``'s, less one, is the added time.
"""

from __future__ import annotations

import contextlib
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
from connector.identity import weights_digests  # noqa: E402
from connector.identity.checkpoint import fingerprint  # noqa: E402
from connector.identity.weights_digests import DigestCache  # noqa: E402
from connector.vllm_plugin.weights_hook import COUNTS, RECENT, read_beside  # noqa: E402

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
    for p in folder.glob("*.safetensors"):
        with open(p, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def vllm_read(folder: Path, hash_beside: bool = False) -> None:
    """vLLM 0.32's read of a safetensors checkpoint, each tensor copied into a parameter-sized
    buffer (as ``weight_loader`` copies it into the model) and dropped; ``hash_beside``: with
    the KVLens plugin's read-along around the iterator."""
    import torch
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    files = [str(p) for p in sorted(folder.glob("*.safetensors"))]
    weights = safetensors_weights_iterator(files, False)
    for _, tensor in read_beside(weights, files) if hash_beside else weights:
        torch.empty_like(tensor).copy_(tensor)


@contextlib.contextmanager
def fresh_digest_cache(folder: Path) -> Iterator[Path]:
    """A digest cache that remembers nothing yet (the plugin reads KVLENS_WEIGHTS_DIGESTS)."""
    path = folder / "read-along" / "weights-digests.json"
    shutil.rmtree(path.parent, ignore_errors=True)
    before = os.environ.get(weights_digests.ENV)
    os.environ[weights_digests.ENV] = str(path)
    try:
        yield path
    finally:
        if before is None:
            del os.environ[weights_digests.ENV]
        else:
            os.environ[weights_digests.ENV] = before


class CheckpointIdentity(Benchmark):
    name = "checkpoint_identity"
    figures = (
        Figure("ms", "ms", "{:.1f}", ratio=True, log=True),
        Figure("wait_ms", "hash wait after the read, ms", "{:.0f}", plot=False),
        # CPU time of this process (every thread): steadier than wall time on a shared machine
        Figure("cpu_s", "CPU s", "{:.1f}", ratio=True, plot=False),
    )
    baselines = ("vllm-read",)
    case_label = "page cache"
    repeat_flags = ("--repeat",)
    options = {
        "gb": Option(16.0, 0.2, "checkpoint size"),
        "dir": Option(None, help="where to build it (default: a temporary folder)"),
        "keep": Option(False, help="keep the checkpoint"),
        "skip_vllm": Option(False, help="do not time vLLM's read"),
    }

    def sides(self) -> list[Side]:
        read = (
            []
            if self.args.skip_vllm
            else [
                Side("vllm-read", "vLLM's read of the weights"),
                Side("vllm-read+hash", "vLLM's read with the KVLens plugin hashing beside it"),
            ]
        )
        return [
            Side("identity", "KVLens's identity, no digest remembered"),
            Side("identity-cached", "KVLens's identity, digests remembered"),
            *read,
        ]

    def cases(self) -> list[Case]:
        # after-vllm: pages dropped, then vLLM's read (untimed), then the mode: what KVLens's
        # start-up meets, as the scheduler half starts after vLLM has loaded the weights
        return [Case("warm", "warm"), Case("cold", "cold"), Case("after-vllm", "after-vllm")]

    def applies(self, side: Side, case: Case) -> bool:
        # the plugin's hash replaces the identity's pass after vLLM's read; vLLM's read twice
        # in a row says nothing
        if case.params == "after-vllm":
            return side.name.startswith("identity")
        return True

    @contextlib.contextmanager
    def setup(self) -> Iterator[None]:
        self.folder = Path(self.args.dir or tempfile.mkdtemp(prefix="kvlens-ckpt-"))
        self.folder.mkdir(parents=True, exist_ok=True)
        if not self.args.skip_vllm:
            import torch
            import vllm.model_executor.model_loader.weight_utils  # noqa: F401 - imported untimed

            torch.set_num_threads(1)  # copies on one thread: spinning OpenMP threads on a shared machine
        try:
            started = time.perf_counter()
            self.size = write_checkpoint(self.folder, self.args.gb, SHARDS)
            os.sync()  # dirty pages cannot be dropped
            self.cache = DigestCache(str(self.folder / "digests.json"))
            if any(s.name == "identity-cached" for s in self.modes):
                found = fingerprint(str(self.folder), self.cache)
                self.read_bytes, self.total_bytes = found.read_bytes, found.total_bytes
            else:
                self.read_bytes = self.total_bytes = self.size
            print(
                f"   checkpoint: {self.size / 1e9:.1f} GB in {SHARDS} shards, written in "
                f"{time.perf_counter() - started:.0f}"
                f" s; the identity reads {self.read_bytes / 1e9:.1f} GB",
                flush=True,
            )
            yield
        finally:
            if not self.args.keep:
                shutil.rmtree(self.folder, ignore_errors=True)

    def measure(self, side: Side, case: Case, rep: int) -> dict[str, float]:
        if case.params != "warm":
            drop_cache(self.folder)
        if case.params == "after-vllm":
            vllm_read(self.folder)
        cpu = time.process_time()
        started = time.perf_counter()
        if side.name == "identity":
            fingerprint(str(self.folder))
        elif side.name == "identity-cached":
            found = fingerprint(str(self.folder), DigestCache(self.cache.path))
            assert found.read_bytes == 0, "the digests were not remembered"
        elif side.name == "vllm-read":
            vllm_read(self.folder)
        else:
            return {**self._read_with_hash(started), "cpu_s": time.process_time() - cpu}
        return {"ms": (time.perf_counter() - started) * 1e3, "cpu_s": time.process_time() - cpu}

    def _read_with_hash(self, started: float) -> dict[str, float]:
        with fresh_digest_cache(self.folder) as path:
            finished = COUNTS["finished"]
            vllm_read(self.folder, hash_beside=True)
            ms = (time.perf_counter() - started) * 1e3
            assert COUNTS["finished"] == finished + 1, "the plugin's read-along fell back"
            found = fingerprint(str(self.folder), DigestCache(str(path)))
            assert found.cached_files == found.files, "the plugin did not remember every digest"
        return {"ms": ms, "wait_ms": RECENT[-1].waited_s * 1e3}

    def workload(self) -> dict[str, Any]:
        return {
            "checkpoint_bytes": self.size,
            "shards": SHARDS,
            "identity_read_bytes": self.read_bytes,
            "identity_total_bytes": self.total_bytes,
        }


if __name__ == "__main__":
    sys.exit(main(CheckpointIdentity))
