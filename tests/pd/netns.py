"""A second "host" on this machine: a network namespace joined to this one by a veth pair.

A process started with ``NetNamespace.exec`` sees only its own loopback and the veth address
(``inner``); this namespace reaches it at ``inner`` and it reaches this one at ``outer``, and
nothing else. Needs root (or CAP_NET_ADMIN) and iproute2; ``available()`` says whether this
machine can make one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class NetNamespace:
    name: str
    outer: str  # this namespace's end of the veth
    inner: str  # the other host's address

    @property
    def exec(self) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.name)

    def delete(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)  # its veth goes with it


def create(index: int = 0) -> NetNamespace:
    """A namespace ``kvlens-<pid>-<index>`` with 10.<x>.<y>.2 inside and .1 outside."""
    tag = f"{os.getpid() % 10000}{index}"
    name, outside, inside = f"kvlens-{tag}", f"kvo{tag}", f"kvi{tag}"
    x, y = 200 + index % 50, os.getpid() % 250
    outer, inner = f"10.{x}.{y}.1", f"10.{x}.{y}.2"
    _ip("netns", "add", name)
    ns = NetNamespace(name, outer, inner)
    try:
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", name)
        _ip("addr", "add", f"{outer}/30", "dev", outside)
        _ip("link", "set", outside, "up")
        _ip("netns", "exec", name, "ip", "addr", "add", f"{inner}/30", "dev", inside)
        _ip("netns", "exec", name, "ip", "link", "set", inside, "up")
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
    except BaseException:
        ns.delete()
        raise
    return ns


def available() -> str | None:
    """None when a namespace can be made here, else why not."""
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    try:
        create(9).delete()
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        return f"cannot create a network namespace here: {detail.strip()}"
    return None
