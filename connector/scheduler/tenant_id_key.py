"""The deployment's key for tenant ids (``engine/tenants.py``): what keeps an id on
``/metrics`` from confirming a guessed cache salt.

In order: ``extra_config.tenant_id_key`` (a secret of 16 or more characters), the file named by
``extra_config.tenant_id_key_file``, else a random key generated once and kept with the cache,
so that instances sharing the cache compute the same ids and ids survive restarts: in the Redis
prefix (``<prefix>:tenant-id-key``, created with ``SET NX``, never expiring), else in the disk
directory (``.kvlens-namespaces/tenant-id-key``, see ``secret_file.py``: mode 0600, never seen
half-written, in a folder that must be this user's), else in the user's state directory (as the event log). A
store that cannot be reached falls through to the next; when none can be written, this
process's ids are its own. Whoever can read the key's store can compute ids from guesses: the
same people who can read the cache itself.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from ..config.model import KVLensConfig
from .secret_file import write_once

logger = logging.getLogger("vllm.kvlens")

KEY_NAME = "tenant-id-key"
KEY_BYTES = 32
_MIN_STORED = 16


def deployment_key(config: KVLensConfig) -> bytes:
    """The deployment's key (see the module's docstring), at least 16 bytes."""
    extra = config.extra_config
    if extra.tenant_id_key is not None:
        return _derived(extra.tenant_id_key.get_secret_value().encode())
    if extra.tenant_id_key_file is not None:
        with open(extra.tenant_id_key_file, "rb") as f:  # unreadable: a start-up error, as configured
            secret = f.read(4096).strip()
        if len(secret) < 16:
            raise ValueError(f"{extra.tenant_id_key_file}: a tenant id key needs 16 or more characters")
        return _derived(secret)
    places = []
    if config.remote is not None:
        places.append(("the Redis prefix", lambda: _in_redis(config)))
    if config.local_disk:
        places.append(
            ("the disk directory", lambda: _in_file(os.path.join(config.local_disk, ".kvlens-namespaces")))
        )
    places.append(("the state directory", lambda: _in_file(_state_dir())))
    for where, kept in places:
        try:
            return kept()
        except Exception as e:  # noqa: BLE001 - any store failure: try the next place
            logger.warning("KVLens: the tenant id key could not be kept in %s: %s", where, e)
    logger.warning("KVLens: tenant ids of this process use a key of its own (not shared, not kept)")
    return os.urandom(KEY_BYTES)


def _derived(secret: bytes) -> bytes:
    return hashlib.blake2b(secret, digest_size=KEY_BYTES, person=b"kvlens-tenants").digest()


def _in_file(folder: str) -> bytes:
    path = Path(folder) / KEY_NAME
    key = write_once(path, os.urandom(KEY_BYTES), replace=False)
    if len(key) < _MIN_STORED:
        raise ValueError(f"{path} holds no key (remove it to have one made)")
    return key[: KEY_BYTES + 1]


def _in_redis(config: KVLensConfig) -> bytes:
    from ..tiers.redis_tier import RedisTier

    assert config.remote is not None
    extra = config.extra_config
    tier = RedisTier(config.remote, "", extra.remote_key_prefix, None, extra.remote_timeout_s)
    try:
        name = tier.key(KEY_NAME)
        made, key = tier.execute("tenant_id_key", [("SET", name, os.urandom(KEY_BYTES), "NX"), ("GET", name)])
    finally:
        tier.close()
    for reply in (made, key):
        if isinstance(reply, Exception):
            raise reply
    if not isinstance(key, bytes) or len(key) < _MIN_STORED:
        raise ValueError(f"{name} holds no key")
    return key


def _state_dir() -> str:
    """``$XDG_STATE_HOME/kvlens`` or ``~/.local/state/kvlens`` (where the event log goes)."""
    state = os.environ.get("XDG_STATE_HOME")
    if state:
        return os.path.join(state, "kvlens")
    home = os.environ.get("HOME") or os.path.expanduser("~")
    if not home or home == "~" or not os.path.isdir(home):
        raise OSError("no home directory and no XDG_STATE_HOME")
    return os.path.join(home, ".local", "state", "kvlens")
