"""Which local addresses a TCP port is listening on, read from the kernel (Linux)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

_LISTEN = "0A"


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))  # four host-order words
    return str(ipaddress.IPv6Address(words))


def listening_addresses(port: int) -> set[str]:
    """The local addresses of the sockets listening on ``port`` ("0.0.0.0" or "::": all)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state = fields[1], fields[3]
            address, hex_port = local.split(":")
            if state == _LISTEN and int(hex_port, 16) == port:
                found.add(_address(address))
    return found
