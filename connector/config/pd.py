"""Prefill/decode disaggregation (PD) settings: LMCache's ``pd_*`` keys, read as LMCache reads them.

``enable_pd: true`` with ``transfer_channel: tcp`` makes KVLens a PD prefiller (``pd_role:
sender``) or decoder (``pd_role: receiver``) over its own TCP data plane (connector/pd/). With PD
off, every ``pd_*`` key is an LMCache key KVLens does not use (one warning). A channel KVLens does
not have (nixl, mooncake, ...) stops start-up. LMCache's older form (``enable_nixl`` with
``nixl_*`` keys) means the same when ``transfer_channel: tcp`` is given.

Two kinds of check: ``read`` (here, at load: the keys alone) and ``check_for_engine`` (at the
connector's start, once vLLM's kv_role, TP size and chunk bytes are known).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from .keys import lmcache_bool
from .pd_trust import beyond_loopback, is_loopback, read_key, read_receivers

# The current key each PD key (or its older LMCache name) means. Aliases of keys.ALIASES
# (nixl_role, nixl_buffer_size, ...) are resolved before these.
LEGACY_PD = {
    "enable_nixl": "enable_pd",
    "nixl_buffer_device": "pd_buffer_device",
    "nixl_receiver_host": "pd_peer_host",
    "nixl_receiver_port": "pd_peer_init_port",
    "nixl_peer_port": "pd_peer_init_port",
}
# Keys that only ever mean something with PD on.
PD_KEYS = frozenset(
    """enable_pd pd_role pd_buffer_size pd_buffer_device pd_peer_host pd_peer_init_port
    pd_peer_alloc_port pd_proxy_host pd_proxy_port pd_allocation_timeout_sec pd_shutdown_timeout_sec
    pd_max_prefill_len pd_skip_proxy_notification pd_backend_mode transfer_channel
    pd_unclaimed_timeout_sec pd_transfer_timeout_sec pd_bidirectional pd_auth_key pd_auth_key_file
    pd_allow_unauthenticated pd_allowed_receivers pd_tls pd_tls_cert_file pd_tls_key_file
    pd_tls_ca_file""".split()
) | frozenset(LEGACY_PD)
SECRET_KEYS = frozenset({"pd_auth_key"})  # never shown, not even in an error
# PD keys KVLens reads but has no use for (with what KVLens does instead).
PD_UNUSED = {
    "pd_allocation_timeout_sec": "KVLens's receiver answers an allocation at once (buffer_full), "
    "never retried",
    "pd_backend_mode": "KVLens's sender always runs on its own thread",
}
CHANNEL = "tcp"
OTHER_CHANNELS = ("nixl", "mooncake", "mooncake_store", "hccl", "rdma", "ucx", "p2p", "nccl")
DEFAULT_TRANSFER_TIMEOUT_S = 10.0
DEFAULT_UNCLAIMED_TIMEOUT_S = 60.0
ALLOC_PORT_OFFSET = 100  # pd_peer_alloc_port when only init ports are given (LMCache: 7300, 7400)
MAX_PORTS = 1024  # one per TP rank: far more than any engine has


@dataclass(frozen=True, slots=True)
class PDConfig:
    """What KVLens does as a PD prefiller or decoder (``enabled`` false: neither)."""

    enabled: bool = False
    role: str | None = None  # "sender" (prefiller) | "receiver" (decoder)
    buffer_size: int = 0  # bytes per rank: the decoder's receive buffer, the sender's in-flight bytes
    buffer_device: str = "cpu"  # "cpu" | "cuda": KVLens's buffer is host shared memory either way
    peer_host: str | None = None  # the receiver binds here
    peer_init_ports: tuple[int, ...] = ()  # receiver: one per TP rank
    peer_alloc_ports: tuple[int, ...] = ()
    proxy_host: str | None = None  # sender: where ProxyNotif goes
    proxy_port: int | None = None
    shutdown_timeout_s: float = 5.0
    max_prefill_len: int = 0  # > 0: the buffer must hold this many tokens (checked at start)
    skip_proxy_notification: bool = False
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S  # a silent sender's slots are freed
    unclaimed_timeout_s: float = DEFAULT_UNCLAIMED_TIMEOUT_S  # received, never looked up: freed
    allocation_timeout_s: float = math.inf  # LMCache's; KVLens never waits for room
    # Who may hand a decoder KV (connector/pd/auth.py): the shared secret, and where it came from
    # ("pd_auth_key", "pd_auth_key_file", "store_auth_key", ...; "" without one).
    auth_key: bytes | None = field(default=None, repr=False)
    auth_source: str = ""
    allow_unauthenticated: bool = False  # the operator's written choice: no key beyond loopback
    allowed_receivers: tuple[str, ...] = ()  # sender: beyond loopback, where it may send
    tls: bool = False
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_ca_file: str | None = None

    @property
    def sender(self) -> bool:
        return self.enabled and self.role == "sender"

    @property
    def receiver(self) -> bool:
        return self.enabled and self.role == "receiver"

    @property
    def notifies_proxy(self) -> bool:
        return self.sender and not self.skip_proxy_notification and self.proxy_port is not None


@dataclass
class PDFindings:
    """What ``read`` found: the settings, or problems; and the keys accepted but not used."""

    config: PDConfig = field(default_factory=PDConfig)
    refused: list[str] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)


def _bool(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float | str):
        text = str(value).strip().lower()
        if text in ("true", "1"):
            return True
        if text in ("false", "0", ""):
            return False
    return None


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
            text = text[1:-1]
        return text or None
    return None


def _ports(value: Any) -> tuple[int, ...] | None:
    """A port or a list of ports (YAML list, "7300,7301", "[7300, 7301]"); None: not ports."""
    if isinstance(value, str):
        text = value.strip().strip("[]")
        value = [p for p in text.replace(",", " ").split()] if text else []
    if isinstance(value, int | str) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list | tuple) or len(value) > MAX_PORTS:
        return None
    out = []
    for p in value:
        try:
            port = int(str(p).strip()) if not isinstance(p, bool | float) else -1
        except ValueError:
            return None
        if not 1 <= port <= 65535:
            return None
        out.append(port)
    return tuple(out)


def _one_port(value: Any) -> int | None:
    ports = _ports(value)
    return ports[0] if ports is not None and len(ports) == 1 else None


def _number(value: Any, kind: Callable[[Any], Any], low: float, inf_ok: bool = False) -> Any:
    if isinstance(value, bool) or value is None:
        return None
    try:
        n = kind(str(value).strip()) if isinstance(value, str) else kind(value)
    except (ValueError, OverflowError):
        return None
    if isinstance(n, float) and (math.isnan(n) or (math.isinf(n) and not inf_ok)):
        return None
    return n if n >= low else None


def read(settings: Mapping[str, tuple[Any, str, str]]) -> PDFindings:
    """The PD settings from ``{current key: (value, source, key as written)}`` (aliases resolved)."""
    f = PDFindings()
    s = {k: (v[0], v[1]) for k, v in settings.items()}
    written = {k: v[2] for k, v in settings.items()}
    for old, new in LEGACY_PD.items():  # the older name counts only when the current one is absent
        if old in s:
            if new in s:
                f.unused.append(f"{old} (from {s[old][1]}; {new} is set)")
            else:
                s[new] = s[old]
                written[new] = written.get(old, old)
            del s[old]
    enable = s.pop("enable_pd", (False, ""))
    if not lmcache_bool(enable[0]):  # LMCache's reading: only true and 1 (any case) turn it on
        f.unused += [f"{k} (from {src}; enable_pd is off)" for k, (_, src) in s.items()]
        return f
    where = f"{written.get('enable_pd', 'enable_pd')} = {enable[0]!r} (from {enable[1]})"
    channel_value, channel_src = s.pop("transfer_channel", (None, ""))
    channel = (_text(channel_value) or "").lower()
    if channel != CHANNEL:
        shown = (
            f"transfer_channel = {channel_value!r} (from {channel_src})" if channel else "no transfer_channel"
        )
        f.refused.append(
            f"{where} with {shown}: LMCache's {channel or 'NIXL'} transfer channel is not supported by "
            f"KVLens; instead: transfer_channel: {CHANNEL} (KVLens's own TCP data plane between each "
            "prefiller rank and decoder rank)"
        )
    values: dict[str, Any] = {"enabled": True}
    role_value, role_src = s.pop("pd_role", (None, ""))
    role = (_text(role_value) or "").lower()
    if role not in ("sender", "receiver"):
        f.invalid.append(
            f"{where} needs pd_role: sender (a prefiller) or receiver (a decoder)"
            + (f"; pd_role (from {role_src}) is {role_value!r}" if role_value is not None else "")
        )
    values["role"] = role or None

    def take(key: str, parse: Callable[[Any], Any], what: str, target: str) -> None:
        if key not in s:
            return
        value, src = s.pop(key)
        parsed = parse(value)
        if parsed is None:
            f.invalid.append(f"{key} (from {src}) must be {what}, not {value!r}"[:300])
        else:
            values[target] = parsed

    take("pd_buffer_size", lambda v: _number(v, int, 1), "a number of bytes > 0", "buffer_size")
    take("pd_peer_host", _text, "a host name or address", "peer_host")
    take(
        "pd_peer_init_port", _ports, "a port or a list of ports (1-65535), one per TP rank", "peer_init_ports"
    )
    take(
        "pd_peer_alloc_port",
        _ports,
        "a port or a list of ports (1-65535), one per TP rank",
        "peer_alloc_ports",
    )
    take("pd_proxy_host", _text, "a host name or address", "proxy_host")
    take("pd_proxy_port", _one_port, "one port (1-65535)", "proxy_port")
    take("pd_shutdown_timeout_sec", lambda v: _number(v, float, 0), "seconds >= 0", "shutdown_timeout_s")
    take("pd_max_prefill_len", lambda v: _number(v, int, 0), "a number of tokens >= 0", "max_prefill_len")
    take("pd_skip_proxy_notification", _bool, "true or false", "skip_proxy_notification")
    take("pd_transfer_timeout_sec", lambda v: _number(v, float, 0.001), "seconds > 0", "transfer_timeout_s")
    take("pd_unclaimed_timeout_sec", lambda v: _number(v, float, 0.001), "seconds > 0", "unclaimed_timeout_s")
    take(
        "pd_allocation_timeout_sec",
        lambda v: _number(v, float, 0, inf_ok=True),
        "seconds >= 0",
        "allocation_timeout_s",
    )
    take("pd_allow_unauthenticated", _bool, "true or false", "allow_unauthenticated")
    take("pd_tls", _bool, "true or false", "tls")
    for name in ("cert", "key", "ca"):
        take(f"pd_tls_{name}_file", _text, "a file path", f"tls_{name}_file")
    take(
        "pd_allowed_receivers",
        lambda v: read_receivers(v, f.invalid),
        "a list of hosts, host:port or CIDRs",
        "allowed_receivers",
    )
    read_key(s, values, f.invalid)
    if "pd_buffer_device" in s:
        value, src = s.pop("pd_buffer_device")
        device = (_text(value) or "").lower()
        if device.split(":")[0] not in ("cpu", "cuda"):
            f.invalid.append(f"pd_buffer_device (from {src}) must be cpu or cuda, not {value!r}")
        else:
            values["buffer_device"] = device
            if device != "cpu":
                f.unused.append(
                    f"pd_buffer_device = {value!r} (from {src}; KVLens's PD buffer is host shared memory, "
                    "copied to the KV cache by the existing load path)"
                )
    else:
        f.invalid.append(f"{where} needs pd_buffer_device: cpu (or cuda), as LMCache does")
    if "pd_backend_mode" in s:
        value, src = s.pop("pd_backend_mode")
        if (_text(value) or "").lower() not in ("sync", "async"):
            f.invalid.append(f"pd_backend_mode (from {src}) must be sync or async, not {value!r}")
        else:
            f.unused.append(f"pd_backend_mode (from {src}; {PD_UNUSED['pd_backend_mode']})")
    if "pd_bidirectional" in s:
        value, src = s.pop("pd_bidirectional")
        if _bool(value):
            f.refused.append(
                f"pd_bidirectional = {value!r} (from {src}) turns on LMCache's decoder-to-prefiller "
                "transfer, which is not supported by KVLens; instead: pd_bidirectional: false"
            )
    if "allocation_timeout_s" in values:
        f.unused.append(f"pd_allocation_timeout_sec ({PD_UNUSED['pd_allocation_timeout_sec']})")
    f.unused += [f"{k} (from {src})" for k, (_, src) in s.items()]
    if "buffer_size" not in values:
        f.invalid.append(f"{where} needs pd_buffer_size (bytes per rank), as LMCache does")
    if role == "receiver":
        if "peer_init_ports" not in values:
            f.invalid.append("pd_role receiver needs pd_peer_init_port (one port per TP rank) to listen on")
        if not values.get("peer_host"):
            f.invalid.append("pd_role receiver needs pd_peer_host (the address its ports bind)")
        if "peer_alloc_ports" not in values and values.get("peer_init_ports"):
            # LMCache's older single-port form (nixl_peer_port): its examples pair 7300 with 7400
            values["peer_alloc_ports"] = tuple(p + ALLOC_PORT_OFFSET for p in values["peer_init_ports"])
            f.unused.append(
                "no pd_peer_alloc_port: the receiver takes each pd_peer_init_port + "
                f"{ALLOC_PORT_OFFSET} ({', '.join(map(str, values['peer_alloc_ports']))})"
            )
        inits, allocs = values.get("peer_init_ports", ()), values.get("peer_alloc_ports", ())
        if inits and allocs and len(inits) != len(allocs):
            f.invalid.append(
                f"pd_peer_init_port ({len(inits)} ports) and pd_peer_alloc_port ({len(allocs)} ports) "
                "must list one port per TP rank each"
            )
        if set(inits) & set(allocs) or len(set(inits)) != len(inits) or len(set(allocs)) != len(allocs):
            f.invalid.append("pd_peer_init_port and pd_peer_alloc_port must not repeat a port")
    if role == "sender":
        for key in ("peer_host", "peer_init_ports", "peer_alloc_ports"):
            if key in values:  # the decoder's address comes with each request (disagg_spec)
                del values[key]
                f.unused.append(
                    f"pd_{key.replace('_ports', '_port')} (pd_role sender: the request's "
                    "disagg_spec names the decoder)"
                )
        if not values.get("skip_proxy_notification") and (
            values.get("proxy_port") is None or not values.get("proxy_host")
        ):
            f.unused.append(
                "pd_role sender without pd_proxy_host and pd_proxy_port: no proxy is notified "
                "(as pd_skip_proxy_notification: true)"
            )
            values["skip_proxy_notification"] = True
    if not (f.invalid or f.refused):
        f.config = PDConfig(**values)
    return f


def with_deployment_key(pd: PDConfig, store_key: bytes | None) -> PDConfig:
    """The PD settings with the deployment's ``store_auth_key`` as their key where the operator
    set only that."""
    if pd.enabled and pd.auth_key is None and store_key is not None:
        return replace(pd, auth_key=store_key, auth_source="store_auth_key")
    return pd


_KEY_SETTINGS = (
    "pd_auth_key or pd_auth_key_file (or extra_config.store_auth_key), "
    "the same on every prefiller and decoder"
)


def exposure_problems(pd: PDConfig) -> list[str]:
    """Why these PD settings would accept or send KV beyond loopback without a key (each names
    the settings); nothing when a key is set or ``pd_allow_unauthenticated`` says so."""
    if not pd.enabled or pd.auth_key is not None or pd.allow_unauthenticated:
        return []
    out = []
    if pd.receiver and not is_loopback(pd.peer_host or "127.0.0.1"):
        out.append(
            f"pd_role receiver would listen on pd_peer_host {pd.peer_host!r}, which is not loopback, "
            f"without a key: anyone who reaches its ports could hand this decoder KV. Set {_KEY_SETTINGS}; "
            "or bind pd_peer_host to 127.0.0.1; or accept the risk with pd_allow_unauthenticated: true"
        )
    far = beyond_loopback(pd.allowed_receivers) if pd.sender else []
    if far:
        out.append(
            f"pd_role sender may send KV to {', '.join(far)} (pd_allowed_receivers) without a key: a "
            f"receiver there would not have to prove who it is. Set {_KEY_SETTINGS}; or accept the risk "
            "with pd_allow_unauthenticated: true"
        )
    return out


def tls_problems(pd: PDConfig) -> list[str]:
    """TLS files that are named and cannot be read."""
    out = []
    for key, path in (
        ("pd_tls_cert_file", pd.tls_cert_file),
        ("pd_tls_key_file", pd.tls_key_file),
        ("pd_tls_ca_file", pd.tls_ca_file),
    ):
        if path is not None and pd.tls:
            try:
                with open(path, "rb"):
                    pass
            except OSError as e:
                out.append(f"{key} {path!r} cannot be read: {e.strerror or e}")
    if pd.tls and pd.receiver and not pd.tls_cert_file:
        out.append(
            "pd_tls: true on a receiver needs pd_tls_cert_file (and pd_tls_key_file unless the key is in it)"
        )
    return out


class PDEngineError(ValueError):
    """A PD setting the engine it runs in cannot honour (raised as a ConfigError)."""


def check_for_engine(
    pd: PDConfig, kv_role: str, tp_size: int, chunk_size: int, chunk_bytes: int
) -> list[str]:
    """Problems of ``pd`` in an engine with this kv_role, TP size and bytes per rank of one full
    chunk; each names both settings."""
    if not pd.enabled:
        return []
    out = []
    if pd.sender and kv_role == "kv_consumer":
        out.append("pd_role sender with kv_role kv_consumer: a prefiller stores; use kv_role kv_producer")
    if pd.receiver and kv_role != "kv_consumer":
        out.append(
            f"pd_role receiver with kv_role {kv_role}: a decoder loads what it was sent and stores "
            "nothing; use kv_role kv_consumer"
        )
    if pd.receiver and len(pd.peer_init_ports) != tp_size:
        out.append(
            f"pd_peer_init_port lists {len(pd.peer_init_ports)} port(s) and the tensor-parallel size is "
            f"{tp_size}: list one port per TP rank"
        )
    if pd.receiver and len(pd.peer_alloc_ports) != tp_size:
        out.append(
            f"pd_peer_alloc_port lists {len(pd.peer_alloc_ports)} port(s) and the tensor-parallel size is "
            f"{tp_size}: list one port per TP rank"
        )
    if chunk_bytes > 0 and pd.buffer_size < chunk_bytes:
        out.append(
            f"pd_buffer_size {pd.buffer_size} bytes is smaller than one chunk (chunk_size {chunk_size} "
            f"tokens = {chunk_bytes} bytes per rank)"
        )
    elif pd.max_prefill_len > 0 and chunk_bytes > 0:
        capacity = pd.buffer_size // chunk_bytes * chunk_size
        if capacity < pd.max_prefill_len:
            out.append(
                f"pd_buffer_size {pd.buffer_size} bytes holds {capacity} tokens (chunk_size {chunk_size}), "
                f"fewer than pd_max_prefill_len {pd.max_prefill_len}"
            )
    return out
