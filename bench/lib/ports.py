"""Loopback ports for servers a test or benchmark starts, handed out so no other process takes them.

Binding to port 0 and releasing it (the usual trick) hands out a port from the kernel's ephemeral
range; between the release and the server's own bind, any process that binds to 0 or connects out
(vLLM's ZMQ sockets, another test's server, an HTTP client) may be given the same port, and the
server then fails with "Address already in use" (it did, in CI). These ports come from below the
ephemeral range, which the kernel never hands out on its own, through one counter shared by every
process on the machine (a file under the temporary directory, advanced under a lock), so two
callers, in one process or in many, never get the same port until the range wraps.
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
from pathlib import Path

LOWEST = 20000
COUNTER = Path(tempfile.gettempdir()) / "kvlens-loopback-ports.counter"


def ephemeral_low(proc_file: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    """The lowest port the kernel hands out on its own (32768 where it does not say)."""
    try:
        return int(proc_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _kernel_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(count: int, host: str = "127.0.0.1", counter: Path = COUNTER) -> list[int]:
    """``count`` different ports that nothing listens on now and that no other caller gets next."""
    high = ephemeral_low()
    if high - LOWEST < 1000:  # a kernel lending nearly every port: fall back to its own choice
        return [_kernel_port(host) for _ in range(count)]
    ports: list[int] = []
    counter.touch(exist_ok=True)
    with open(counter, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        text = f.read().strip()
        nxt = int(text) if text.isdigit() else LOWEST + os.getpid() % 1000
        for _ in range(high - LOWEST):
            if len(ports) == count:
                break
            port = nxt if LOWEST <= nxt < high else LOWEST
            nxt = port + 1
            if _bindable(port, host):
                ports.append(port)
        f.seek(0)
        f.truncate()
        f.write(str(nxt))
    if len(ports) < count:
        raise RuntimeError(f"fewer than {count} free ports in {LOWEST}-{high - 1}")
    return ports


def free_port(host: str = "127.0.0.1") -> int:
    """One port, as :func:`free_ports`."""
    return free_ports(1, host)[0]
