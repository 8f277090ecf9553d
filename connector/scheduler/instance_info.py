"""Which instances can share KV: the labels of ``vllm:kvlens_info``.

Two engines exchange KV only if their chunk keys agree (same key fingerprint: model, weights,
dtype, KV layout, parallel size, key version; and same chunk size) and they reach the same
store (a shared disk directory on the same host, or the same Redis under the same key prefix).
The labels say exactly that, so a dashboard table groups instances that can share and flags
those that cannot, and why. No secrets: the remote URL is redacted, and the disk path is hashed.

PD (prefill/decode disaggregation) adds what decides whether a prefiller (``pd_role`` sender)
and a decoder (receiver) can pair, for ``kvlens doctor``: the key space (``key_fingerprint``),
TP size, block and chunk size, the record layout, the decoder's host, ports and buffer size, the
prefiller's proxy. The PD settings are read by their LMCache names (``enable_pd``, ``pd_role``,
``pd_peer_host``, ``pd_peer_init_port``, ``pd_peer_alloc_port``, ``pd_buffer_size``,
``pd_proxy_host``, ``pd_proxy_port``); a configuration without them has PD off.
"""

from __future__ import annotations

import hashlib
import os
import socket
from importlib import metadata

from ..config.loading import KVLensConfig
from ..config.pd import PDConfig
from ..engine.facts import EngineFacts
from ..engine.jobs import DISK, REMOTE
from ..engine.keys import key_fingerprint
from ..engine.snapshots import InstanceInfo


def _version() -> str:
    try:
        return metadata.version("kvlens")
    except metadata.PackageNotFoundError:
        return "unknown"


def disk_identity(path: str) -> str:
    """``disk:<hash of host and real path>``: the same for every engine sharing the directory."""
    where = f"{socket.gethostname()}:{os.path.realpath(path)}"
    return f"{DISK}:{hashlib.blake2b(where.encode(), digest_size=4).hexdigest()}"


def storage_identity(config: KVLensConfig) -> str:
    """Where the shareable tiers live: ``disk:<host+path hash>``, ``remote:<url>/<prefix>``."""
    parts = []
    if config.local_disk:
        parts.append(disk_identity(config.local_disk))
    if config.remote is not None:
        parts.append(f"{REMOTE}:{config.remote.redacted()}/{config.extra_config.remote_key_prefix}")
    return ",".join(parts)


def _ports(value: object) -> str:
    """A port or a list of ports (one per rank) -> "p0,p1"; nothing -> ""."""
    if value is None or value == "":
        return ""
    values = value if isinstance(value, list | tuple) else [value]
    return ",".join(str(int(v)) for v in values)


def pd_labels(config: KVLensConfig, facts: EngineFacts) -> dict[str, object]:
    """The PD fields of the info gauge ("" where PD is off or the role has no such thing)."""
    out: dict[str, object] = {"tp_size": facts.world_size, "block_size": facts.block_size}
    out["record_layout"] = facts.record_layout()
    pd = config.pd
    role = (pd.role or "") if pd.enabled else ""
    out["pd_role"] = role
    if role == "receiver":
        out["pd_host"] = pd.peer_host or ""
        out["pd_init_ports"] = _ports(pd.peer_init_ports)
        out["pd_alloc_ports"] = _ports(pd.peer_alloc_ports)
        out["pd_buffer_size"] = pd.buffer_size
    if role == "sender":
        out["pd_proxy"] = f"{pd.proxy_host}:{pd.proxy_port}" if pd.proxy_host and pd.proxy_port else ""
    if role:
        out["pd_auth"] = pd_auth(pd)
        out["pd_tls"] = "on" if pd.tls else ""
    return out


def pd_auth(pd: PDConfig) -> str:
    """ "key", "loopback" (no key: loopback only) or "unauthenticated" (pd_allow_unauthenticated)."""
    if pd.auth_key is not None:
        return "key"
    return "unauthenticated" if pd.allow_unauthenticated else "loopback"


def instance_info(config: KVLensConfig, facts: EngineFacts) -> InstanceInfo:
    """The labels of the info gauge."""
    identity = facts.identity
    return InstanceInfo(
        version=_version(),
        chunk_size=config.chunk_size,
        key_fingerprint=key_fingerprint(facts.namespace()),
        tiers="+".join(config.tier_names()),
        role=facts.kv_role,
        storage=storage_identity(config),
        model_identity=identity.weights if identity is not None else "",
        quantization=identity.quantization if identity is not None else "",
        kv_cache_dtype=identity.kv_cache_dtype if identity is not None else "",
        **pd_labels(config, facts),  # type: ignore[arg-type]
    )
