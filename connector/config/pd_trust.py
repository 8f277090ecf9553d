"""Whom PD trusts: the key both ends prove (``pd_auth_key``, its file, or the deployment's
``store_auth_key``), where a prefiller may send KV (``pd_allowed_receivers``), and the start-up
rule that keeps a deployment without a key on loopback unless the operator says otherwise
(``pd_allow_unauthenticated``).

A PD request's ``disagg_spec`` names the decoder, and a client of the prefiller's HTTP API can
write any spec: without a list, a client could aim the prefiller at any host and port reachable
from inside the cluster (metadata services, internal names) and read the outcome off the
metrics. So the operator names the receivers: host names, IP addresses or CIDR networks, each
optionally with a port (``decoder-1``, ``10.0.0.7:7300``, ``10.0.0.0/24``, ``[fd00::7]:7300``,
``fd00::/64``). Loopback (``127.0.0.0/8``, ``::1``, ``localhost``) is always allowed, so the
one-host setups of LMCache's examples need no list. A spec naming anything else is refused
before any connection. Names match as written (case and one trailing dot aside), never by
resolving them: a name a client chose is not looked up.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import Any

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
LOOPBACK = ("127.0.0.0/8", "::1", "localhost")


@dataclass(frozen=True, slots=True)
class AllowedReceiver:
    network: IPNetwork | None  # an address or network; None for a host name
    name: str | None  # a host name, lower case, without a trailing dot
    port: int | None  # None: every port

    def admits(self, host: str, port: int) -> bool:
        if self.port is not None and port != self.port:
            return False
        address = _address(host)
        if address is not None:
            return self.network is not None and address in self.network
        return self.name is not None and _name(host) == self.name


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped if mapped is not None else address


def _name(text: str) -> str:
    return text.strip().lower().removesuffix(".")


def _split_port(entry: str) -> tuple[str, int | None]:
    """``host:port``, ``[v6]:port``, a bare v6 address or network (no port), or a bare host."""
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise ValueError(f"{entry!r}: expected [address]:port")
        return host, _port(rest[1:]) if rest else None
    if entry.count(":") == 1:
        host, port = entry.split(":")
        return host, _port(port)
    return entry, None


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"{text!r} is not a port (1-65535)")
    return int(text)


def parse_entry(entry: str) -> AllowedReceiver:
    """One entry of ``pd_allowed_receivers``; ``ValueError`` naming what is wrong with it."""
    text = entry.strip()
    if not text:
        raise ValueError("an empty entry")
    host, port = _split_port(text)
    try:
        network = ipaddress.ip_network(host, strict=False)
    except ValueError:
        network = None
    if network is not None:
        return AllowedReceiver(network, None, port)
    name = _name(host)
    labels = name.split(".")
    if (
        not name
        or len(name) > 253
        or not all(0 < len(p) <= 63 and p.replace("-", "").isalnum() for p in labels)
    ):
        raise ValueError(f"{entry!r} is neither a host name, an address nor a network")
    return AllowedReceiver(None, name, port)


def parse_list(entries: tuple[str, ...]) -> tuple[AllowedReceiver, ...]:
    """Loopback, then the operator's entries."""
    return tuple(parse_entry(e) for e in (*LOOPBACK, *entries))


def admits(allowed: tuple[AllowedReceiver, ...], host: str, ports: tuple[int, ...]) -> bool:
    """Whether every port of ``host`` is one a prefiller may send to."""
    return bool(ports) and all(any(a.admits(host, p) for a in allowed) for p in ports)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only loopback addresses (a name is resolved: it is the operator's
    own setting, read at start-up)."""
    address = _address(host)
    if address is not None:
        return address.is_loopback
    if _name(host) == "localhost":
        return True
    try:
        found = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    return bool(found) and all(_address(str(info[4][0])).is_loopback for info in found)  # type: ignore[union-attr]


def beyond_loopback(entries: tuple[str, ...]) -> list[str]:
    """The operator's entries that admit an address that is not loopback."""
    out = []
    for entry in entries:
        allowed = parse_entry(entry)
        if allowed.network is not None:
            if not (
                allowed.network.network_address.is_loopback and allowed.network.broadcast_address.is_loopback
            ):
                out.append(entry)
        elif allowed.name is not None and not is_loopback(allowed.name):
            out.append(entry)
    return out


def read_receivers(value: Any, invalid: list[str]) -> tuple[str, ...] | None:
    """``pd_allowed_receivers``: a list, or one string of entries split by commas or spaces."""
    if isinstance(value, str):
        value = value.strip().strip("[]").replace(",", " ").split()
    if not isinstance(value, list | tuple) or len(value) > 1024:
        return None
    entries = tuple(str(v).strip().strip("'\"") for v in value)
    for entry in entries:
        try:
            parse_entry(entry)
        except ValueError as e:
            invalid.append(f"pd_allowed_receivers: {e}")
            return ()
    return entries


def read_key(s: dict[str, tuple[Any, str]], values: dict[str, Any], invalid: list[str]) -> None:
    """``pd_auth_key`` (at least 16 characters) or the file ``pd_auth_key_file`` names."""
    literal, path = s.pop("pd_auth_key", (None, "")), s.pop("pd_auth_key_file", (None, ""))
    if literal[0] is not None and path[0] is not None:
        invalid.append(f"set pd_auth_key (from {literal[1]}) or pd_auth_key_file (from {path[1]}), not both")
        return
    if literal[0] is not None:
        secret, where = str(literal[0]).encode(), f"pd_auth_key (from {literal[1]})"
        values["auth_source"] = "pd_auth_key"
    elif path[0] is not None:
        where = f"pd_auth_key_file (from {path[1]})"
        try:
            with open(str(path[0]), "rb") as fh:
                secret = fh.read().removesuffix(b"\n").removesuffix(b"\r")
        except OSError as e:
            invalid.append(f"{where} cannot be read: {e.strerror or e}")
            return
        values["auth_source"] = "pd_auth_key_file"
    else:
        return
    if len(secret) < 16:
        invalid.append(f"{where}: the PD key must be at least 16 characters")
        return
    values["auth_key"] = secret
