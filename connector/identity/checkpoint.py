"""Which weights produced a chunk's KV, from the checkpoint's content, not its place.

Two hosts that each downloaded or copied the same checkpoint hold it at other paths with other
file times, and must still produce the same chunk keys, or a shared store never hits. Any
change to the weights, however small (ten retrained embedding rows, a hundred rows of one
projection), must produce other keys, even when it replaces the checkpoint at the same path.
So every byte of every weight file counts: each is hashed whole (``weights_digests``), on up
to 8 threads, right after vLLM has read the same files (the page cache it leaves makes that a
memory-speed pass), and its digest is remembered per file version so a restart only stats.

Files hashed: the weight files vLLM loads (with its default loaders: the top-level
``*.safetensors`` when there are any, as vLLM picks them over ``*.bin``; with any other load
format every weight file), less vLLM's ignore patterns (``original/**/*``), plus
``*.index.json`` (tensor-to-file maps) and a LoRA adapter's ``adapter_config.json``. File
names count relative to the checkpoint's folder; paths, times and owners do not. The same
function fingerprints LoRA adapters. No vLLM, no torch.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from . import weights_digests as wd

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".h5", ".msgpack", ".tensors")
# Read whole besides the weights: tensor-to-file maps, and a LoRA adapter's rank and scaling.
WHOLE_FILES = (".index.json", "adapter_config.json")
# Load formats whose loader takes the top-level *.safetensors when there are any (vLLM 0.32).
SAFETENSORS_FIRST = ("auto", "safetensors", "fastsafetensors", "runai_streamer")
IGNORE = ("original/**/*",)  # vLLM's default LoadConfig.ignore_patterns
THREADS = min(8, os.cpu_count() or 1)  # the engine is idle then; 8 saturate memory bandwidth


@dataclass(frozen=True, slots=True)
class Fingerprint:
    digest: str  # 16 hex digits
    files: int  # weight and index files counted
    total_bytes: int  # their size
    read_bytes: int  # what was actually read now (0 when every file's digest was remembered)
    cached_files: int = 0  # files whose digest came from the digest cache


def _weight_files(
    path: str, load_format: str = "auto", ignore: tuple[str, ...] = IGNORE
) -> list[tuple[str, str]]:
    """(name relative to the checkpoint, full path) of every file that counts, sorted."""
    if os.path.isfile(path):
        return [(os.path.basename(path), path)]
    found = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            if name.endswith(WEIGHT_SUFFIXES) or name.endswith(WHOLE_FILES):
                full = os.path.join(root, name)
                rel = os.path.relpath(full, path).replace(os.sep, "/")
                if not any(fnmatch.fnmatch(rel, pattern) for pattern in ignore):
                    found.append((rel, full))
    if load_format in SAFETENSORS_FIRST and any(
        "/" not in rel and rel.endswith(".safetensors") for rel, _ in found
    ):
        found = [
            (rel, full)
            for rel, full in found
            if rel.endswith(WHOLE_FILES) or ("/" not in rel and rel.endswith(".safetensors"))
        ]
    return sorted(found)


def fingerprint(
    path: str,
    cache: wd.DigestCache | None = None,
    load_format: str = "auto",
    ignore: tuple[str, ...] = IGNORE,
    threads: int = THREADS,
) -> Fingerprint | None:
    """The content fingerprint of a checkpoint folder (or one weight file); None when it holds
    no weight file. ``cache``: remembered digests (None: hash everything). OSError propagates
    (an unreadable checkpoint is the operator's to fix)."""
    files = _weight_files(path, load_format, ignore)
    if not files:
        return None
    stats = [os.stat(full) for _, full in files]
    digests: list[str | None] = [
        cache.get(wd.file_version(st)) if cache is not None else None for st in stats
    ]
    cached = sum(d is not None for d in digests)
    work = [
        (i, seg) for i, d in enumerate(digests) if d is None for seg in range(wd.segments(stats[i].st_size))
    ]
    read = 0
    if work:
        with ThreadPoolExecutor(max(1, min(threads, len(work))), thread_name_prefix="kvlens-hash") as pool:
            results = list(pool.map(lambda item: wd.segment_digest(files[item[0]][1], item[1]), work))
        parts: dict[int, list[bytes]] = {}
        for (i, _), (part, n) in zip(work, results, strict=True):
            parts.setdefault(i, []).append(part)
            read += n
        for i, file_parts in parts.items():
            if wd.file_version(os.stat(files[i][1])) != wd.file_version(stats[i]):
                raise OSError(f"{files[i][1]} changed while it was hashed")
            digests[i] = wd.combine(stats[i].st_size, file_parts)
            if cache is not None:
                cache.put(wd.file_version(stats[i]), digests[i])
        if cache is not None:
            cache.save()
    h = hashlib.blake2b(digest_size=8, person=b"kvlens-ckpt-v2")
    for (name, _), st, digest in zip(files, stats, digests, strict=True):
        h.update(f"{len(name)}:{name}:{st.st_size}:{digest};".encode())
    return Fingerprint(h.hexdigest(), len(files), sum(st.st_size for st in stats), read, cached)


class AdapterFingerprints:
    """LoRA adapters' fingerprints, computed once per adapter version (bounded memory).

    A request names its adapter by path; re-pointing a name, or replacing the files at a path,
    must not reuse KV, so entries are keyed by the path and its files' sizes and times.
    """

    def __init__(self, capacity: int = 256) -> None:
        self._known: OrderedDict[tuple, str] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def identity(self, path: str) -> str:
        """``lora:<digest>`` of the adapter's content; ``lora-path:<path>`` if it cannot be read."""
        try:
            files = _weight_files(path) if os.path.exists(path) else []
            version = (path, tuple((n, wd.file_version(os.stat(p))) for n, p in files))
        except OSError:
            return f"lora-path:{path}"
        if not files:
            return f"lora-path:{path}"
        with self._lock:
            known = self._known.get(version)
            if known is not None:
                self._known.move_to_end(version)
                return known
        try:
            found = fingerprint(path)
        except OSError:
            return f"lora-path:{path}"
        out = f"lora:{found.digest}" if found is not None else f"lora-path:{path}"
        with self._lock:
            self._known[version] = out
            while len(self._known) > self._capacity:
                self._known.popitem(last=False)
        return out
