"""A finished directory takes the place of the old one whole, or not at all.

The conversion writes into a scratch directory beside the target (the same file system, so a
rename moves it in one step). Publishing renames the old target aside, renames the new one in
and only then removes the old one: a reader that opens files under the target's path meanwhile
finds either the old directory, briefly nothing, or the new one, never half of one, and a file
it already opened stays readable. Scratch and set-aside directories carry the process id in
their names, so what a killed conversion left is recognised and removed by the next one.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from pathlib import Path

SCRATCH = "tmp"
ASIDE = "old"


def _sibling(target: Path, kind: str) -> Path:
    return target.parent / f".{target.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def _owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leftovers(target: Path) -> list[Path]:
    """Scratch and set-aside directories of ``target`` whose process is gone."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(?:{SCRATCH}|{ASIDE})-(\d+)-[0-9a-f]+")
    if not target.parent.is_dir():
        return []
    found = []
    for item in sorted(target.parent.iterdir()):
        match = pattern.fullmatch(item.name)
        if match and not _owner_alive(int(match.group(1))):
            found.append(item)
    return found


def remove_tree(path: Path) -> None:
    """Remove a directory (or a file or link) if it is there; never follows a link."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path)


def scratch_dir(target: Path) -> Path:
    """A new empty directory beside ``target`` (made with the process's umask, as the target's
    parent would be), after removing what killed conversions left there."""
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in leftovers(target):
        remove_tree(stale)
    path = _sibling(target, SCRATCH)
    path.mkdir()
    return path


def readable_by_all(directory: Path) -> None:
    """Files of a checkpoint are read by whichever user serves it: transformers writes the weights
    with mode 0600 (a temporary file renamed), so every file is made 0644."""
    for item in directory.iterdir():
        if item.is_file() and not item.is_symlink():
            item.chmod(0o644)


def publish(ready: Path, target: Path) -> None:
    """Put the directory ``ready`` at ``target``; whatever was there is removed once it is."""
    readable_by_all(ready)
    if not os.path.lexists(target):
        os.rename(ready, target)
        return
    aside = _sibling(target, ASIDE)
    os.rename(target, aside)
    try:
        os.rename(ready, target)
    except BaseException:
        os.rename(aside, target)
        raise
    remove_tree(aside)
