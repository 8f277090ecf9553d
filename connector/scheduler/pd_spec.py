"""A PD request's ``kv_transfer_params`` as LMCache's proxy writes them, bounded and checked.

``{"ret_first_tok": true, "disagg_spec": {"req_id": "...", "receiver_host": "...",
"receiver_init_port": [p0, ...], "receiver_alloc_port": [a0, ...]}}``: one port per decoder TP
rank; prefiller rank r sends to ports[r]. A client can send anything here, so every field is
bounded and checked before it is used, and the receiver it names must be one the operator allows
(``pd_allowed_receivers``, loopback always: config/pd_trust.py), so a client cannot aim the
prefiller at a host of its choice; a bad spec is refused with a reason (counted and logged by the
caller) before any connection, and the request is served without a transfer, never failed.

Pure: neither vLLM nor torch.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..config.pd_trust import AllowedReceiver, admits

MAX_REQ_ID_CHARS = 256
MAX_HOST_CHARS = 253
MAX_PORTS = 1024
_REQ_ID = re.compile(r"^[\x21-\x7e]+$")  # printable ASCII, no spaces
_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


@dataclass(frozen=True, slots=True)
class DisaggSpec:
    """Where a prefiller sends a request's KV: the decoder's host and one port pair per rank."""

    req_id: str  # the proxy's id, echoed in ProxyNotif
    host: str
    init_ports: tuple[int, ...]
    alloc_ports: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PDParams:
    spec: DisaggSpec | None
    ret_first_tok: bool


class SpecRefused(ValueError):
    """A disagg_spec that cannot be used; ``reason`` is a short label for metrics."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _host(value: object) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_HOST_CHARS:
        raise SpecRefused(
            "bad_host", f"receiver_host must be a host name or address of at most {MAX_HOST_CHARS} characters"
        )
    try:
        ipaddress.ip_address(value.strip("[]"))
        return value.strip("[]")
    except ValueError:
        pass
    labels = value.rstrip(".").split(".")
    if not all(_HOST_LABEL.match(label) for label in labels):
        raise SpecRefused("bad_host", "receiver_host is neither an IP address nor a host name")
    return value


def _ports(value: object, name: str, world_size: int) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or not value or len(value) > MAX_PORTS:
        raise SpecRefused("bad_ports", f"{name} must be a list of ports, one per decoder rank")
    out = []
    for p in value:
        if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= 65535:
            raise SpecRefused("bad_ports", f"{name} holds something that is not a port (1-65535)")
        out.append(p)
    if len(out) != world_size:
        raise SpecRefused(
            "tp_mismatch",
            f"{name} lists {len(out)} decoder ranks; this prefiller has {world_size} (rank r sends to r)",
        )
    return tuple(out)


def usable_req_id(params: Mapping[str, object] | None) -> str | None:
    """The proxy's id in a spec refused for another reason (its proxy is still told), if usable."""
    raw = params.get("disagg_spec") if params else None
    req_id = raw.get("req_id") if isinstance(raw, Mapping) else None
    if isinstance(req_id, str) and 0 < len(req_id) <= MAX_REQ_ID_CHARS and _REQ_ID.match(req_id):
        return req_id
    return None


def read_pd_params(
    params: Mapping[str, object] | None, world_size: int, allowed: tuple[AllowedReceiver, ...]
) -> PDParams | None:
    """The request's PD parameters, or None when it has none. Raises SpecRefused for a spec
    that cannot be used, or that names a receiver not in ``allowed`` (``ret_first_tok`` alone is
    always honoured by the caller's fallback)."""
    if not params or ("disagg_spec" not in params and "ret_first_tok" not in params):
        return None
    ret = params.get("ret_first_tok", False)
    ret_first_tok = ret is True
    raw = params.get("disagg_spec")
    if raw is None:
        return PDParams(None, ret_first_tok)
    if not isinstance(raw, Mapping):
        raise SpecRefused("bad_spec", "disagg_spec must be a mapping")
    req_id = raw.get("req_id")
    if not isinstance(req_id, str) or not 0 < len(req_id) <= MAX_REQ_ID_CHARS or not _REQ_ID.match(req_id):
        raise SpecRefused(
            "bad_req_id", f"disagg_spec.req_id must be 1-{MAX_REQ_ID_CHARS} printable characters"
        )
    host = _host(raw.get("receiver_host"))
    init = _ports(raw.get("receiver_init_port"), "receiver_init_port", world_size)
    alloc = _ports(raw.get("receiver_alloc_port"), "receiver_alloc_port", world_size)
    if not admits(allowed, host, init):
        raise SpecRefused(
            "receiver_not_allowed",
            "receiver_host and receiver_init_port name a receiver pd_allowed_receivers does not list",
        )
    return PDParams(DisaggSpec(req_id, host, init, alloc), ret_first_tok)
