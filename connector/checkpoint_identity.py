"""Which weights produced a chunk's KV, from the checkpoint's content, not its place.

Two hosts that each downloaded or copied the same checkpoint hold it at other paths with other
file times, and must still produce the same chunk keys, or a shared store never hits. A
fine-tune with the same file names, tensor names, shapes and sizes must produce other keys,
even when it replaces the checkpoint at the same path. Reading a whole checkpoint at start-up
is too slow (minutes for 16 GB from disk), so a fingerprint reads what is cheap and sufficient:

- a ``.safetensors`` file: its size, its header (every tensor's name, dtype, shape and offsets)
  and ``SAMPLE_BYTES`` from the middle of every tensor's data: a fine-tune changes whole
  tensors, so changing any tensor changes the fingerprint, at one small read per tensor;
- any other weight file (``.bin``, ``.pt``, ``.gguf``, ...): its size, its first
  ``HEAD_BYTES`` (pickle or GGUF metadata) and ``RANGES`` evenly spaced ranges of it;
- ``*.index.json`` (they map tensors to files) and a LoRA adapter's ``adapter_config.json``
  whole.

File names count relative to the checkpoint's folder; paths, times and owners do not. The
same function fingerprints LoRA adapters. No vLLM, no torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".h5", ".msgpack")
SAMPLE_BYTES = 64  # read from the middle of every safetensors tensor
HEAD_BYTES = 1 << 20  # of other weight files
RANGE_BYTES = 4096
RANGES = 16
_MAX_HEADER = 100 << 20  # safetensors refuses larger headers too


@dataclass(frozen=True, slots=True)
class Fingerprint:
    digest: str  # 16 hex digits
    files: int  # weight and index files read
    total_bytes: int  # their size
    read_bytes: int  # what was actually read


# Read whole besides the weights: tensor-to-file maps, and a LoRA adapter's rank and scaling.
WHOLE_FILES = (".index.json", "adapter_config.json")


def _weight_files(path: str) -> list[tuple[str, str]]:
    """(name relative to the checkpoint, full path) of every weight and index file, sorted."""
    if os.path.isfile(path):
        return [(os.path.basename(path), path)]
    found = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            if name.endswith(WEIGHT_SUFFIXES) or name.endswith(WHOLE_FILES):
                full = os.path.join(root, name)
                found.append((os.path.relpath(full, path).replace(os.sep, "/"), full))
    return sorted(found)


def _safetensors(f, size: int, h) -> int:
    """Header and a sample of every tensor; bytes read. Raises ValueError if not safetensors."""
    raw = f.read(8)
    if len(raw) < 8:
        raise ValueError("too short")
    (n,) = struct.unpack("<Q", raw)
    if n > min(_MAX_HEADER, size - 8):
        raise ValueError("bad header length")
    header_bytes = f.read(n)
    header = json.loads(header_bytes)
    h.update(header_bytes)
    read = 8 + n
    spans = sorted(
        tuple(v["data_offsets"])
        for k, v in header.items()
        if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v
    )
    for begin, end in spans:
        at = 8 + n + begin + max((end - begin) // 2 - SAMPLE_BYTES // 2, 0)
        f.seek(at)
        sample = f.read(min(SAMPLE_BYTES, end - begin))
        h.update(sample)
        read += len(sample)
    return read


def _ranges(f, size: int, h) -> int:
    """The head and evenly spaced ranges of a file of unknown format; bytes read."""
    head = f.read(HEAD_BYTES)
    h.update(head)
    read = len(head)
    if size > HEAD_BYTES:
        step = (size - HEAD_BYTES) // RANGES
        for i in range(RANGES):
            f.seek(HEAD_BYTES + i * step + max(step - RANGE_BYTES, 0) // 2)
            chunk = f.read(RANGE_BYTES)
            h.update(chunk)
            read += len(chunk)
    return read


def fingerprint(path: str) -> Fingerprint | None:
    """The content fingerprint of a checkpoint folder (or one weight file); None when it holds
    no weight file. OSError propagates (an unreadable checkpoint is the operator's to fix)."""
    files = _weight_files(path)
    if not files:
        return None
    h = hashlib.blake2b(digest_size=8, person=b"kvlens-ckpt-v1")
    total = read = 0
    for name, full in files:
        size = os.path.getsize(full)
        total += size
        h.update(f"{len(name)}:{name}:{size};".encode())
        with open(full, "rb") as f:
            if name.endswith(WHOLE_FILES):
                data = f.read()
                h.update(data)
                read += len(data)
                continue
            if name.endswith(".safetensors"):
                try:
                    read += _safetensors(f, size, h)
                    continue
                except (ValueError, UnicodeDecodeError, KeyError, TypeError):
                    f.seek(0)  # not what its name says: sampled like any other file
            read += _ranges(f, size, h)
    return Fingerprint(h.hexdigest(), len(files), total, read)


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
            version = (path, tuple((n, os.stat(p).st_size, os.stat(p).st_mtime_ns) for n, p in files))
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
