"""Secret files made once and shared by a deployment's instances: the admin endpoint's token
(``admin_token.py``) and the key for tenant ids (``tenant_id_key.py``).

A secret is written to a scratch file (mode 0600) and then linked or renamed into place, so a
reader never sees half of one; the directory is made 0700 when missing and must belong to this
process's user either way: a secret kept in (or read from) a directory someone else controls is
theirs to plant or replace.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

_MAX_READ = 4096


def write_once(path: Path, secret: bytes, *, replace: bool) -> bytes:
    """The secret ``path`` holds after writing ``secret`` there. With ``replace=False`` a file
    already there (or made by another instance meanwhile) wins and its bytes are returned.
    Raises OSError when the directory belongs to another user or cannot be written."""
    folder = path.parent
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    owner = folder.stat().st_uid
    if owner != os.getuid():
        raise OSError(f"{folder} belongs to another user (uid {owner})")
    if not replace and path.exists():
        return _read(path)
    scratch = folder / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secret)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(scratch, path)
            return secret
        try:
            os.link(scratch, path)  # fails if it exists: another instance made it first
        except FileExistsError:
            return _read(path)
        return secret
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(scratch)


def _read(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(_MAX_READ)
