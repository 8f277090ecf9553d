"""The admin endpoint's bearer token: where the engine gets it and where ``kvlens`` finds it.

The engine takes ``extra_config.admin_token``, or the file ``extra_config.admin_token_file``
names (written with a new random token, mode 0600, when it does not exist yet). With neither,
it makes a new random token at each start and writes it, mode 0600, to
``~/.cache/kvlens/admin-<port>.token`` (the directory: ``$KVLENS_ADMIN_TOKEN_DIR``; removed at
shutdown), where
``kvlens`` run by the same user on the same host finds it by the URL's port. ``kvlens`` elsewhere
takes ``--token-file`` or ``$KVLENS_ADMIN_TOKEN``. A token that cannot be written is still
required: the endpoint then answers nobody, and says why in the log.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import secrets
import socket
import urllib.parse
from pathlib import Path

from .secret_file import write_once

logger = logging.getLogger("vllm.kvlens")

TOKEN_ENV = "KVLENS_ADMIN_TOKEN"
DIR_ENV = "KVLENS_ADMIN_TOKEN_DIR"


def default_path(port: int) -> Path:
    """Where an engine with no configured token writes the one it made for ``port``."""
    base = os.environ.get(DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "kvlens")
    return Path(base) / f"admin-{port}.token"


def engine_token(literal: str | None, token_file: str | None, port: int) -> tuple[str, str]:
    """The token the endpoint on ``port`` requires, and where it came from (for the log)."""
    if literal:
        return literal, "extra_config.admin_token"
    if token_file:
        path = Path(token_file)
        if path.exists():
            token = path.read_text().strip()
            if not token:
                raise ValueError(f"extra_config.admin_token_file {token_file} is empty")
            if path.stat().st_mode & 0o077:
                logger.warning("KVLens: %s is readable by other users: chmod 600 it", token_file)
            return token, str(path)
        return _write_new(path, replace=False), str(path)
    return _write_new(default_path(port), replace=True), str(default_path(port))


def _write_new(path: Path, replace: bool) -> str:
    """A new random token written to ``path`` (see ``secret_file.write_once``). With
    ``replace=False`` an existing file wins (another engine of the deployment wrote it first)."""
    token = secrets.token_urlsafe(32)
    try:
        kept = write_once(path, (token + "\n").encode(), replace=replace)
        token = kept.decode(errors="replace").strip() or token
    except OSError as e:
        logger.warning(
            "KVLens: the admin endpoint's token could not be written to %s (%s); it answers nobody. "
            "Set extra_config.admin_token_file to a writable path",
            path,
            e,
        )
    return token


def forget(token: str, port: int) -> None:
    """At shutdown: remove the file ``engine_token`` made for ``port`` (no configured token),
    unless another engine has replaced it since."""
    path = default_path(port)
    with contextlib.suppress(OSError):
        if path.read_text().strip() == token:
            path.unlink()


def client_token(url: str, token_file: str | None = None, env: dict[str, str] | None = None) -> str | None:
    """The token ``kvlens`` sends to ``url``: ``--token-file``, ``$KVLENS_ADMIN_TOKEN``, or the
    file an engine on this host wrote for the URL's port, if the URL names this host (None:
    none found)."""
    env = os.environ if env is None else env
    if token_file:
        return Path(token_file).read_text().strip()
    if env.get(TOKEN_ENV):
        return env[TOKEN_ENV].strip()
    parts = urllib.parse.urlsplit(url)
    if parts.port is None or not _this_host(parts.hostname or ""):
        return None  # an engine elsewhere: never send it this host's token
    port = parts.port
    path = default_path(port)
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _this_host(name: str) -> bool:
    name = name.lower().rstrip(".")
    if name in ("localhost", socket.gethostname().lower()):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
