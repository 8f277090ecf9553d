"""The receiver's connections: who gets a slot, and who gives one up.

At most ``max_connections`` connections are served at once. A connection is *handshaking*
until its peer has proven the key (or, without a key, said who it is), *idle* between
transfers, or *busy* in one. Peers that have not authenticated can hold at most
``max_handshaking`` slots (each for at most the handshake timeout), so a flood of them never
takes the slots of the operator's prefillers: when they are all taken, the oldest of them is
closed for the newcomer (a flood churns itself; a genuine sender's handshake takes milliseconds).
When every slot is taken, the connection idle the longest is closed to admit the new one (a kept
connection costs its sender one reconnect). A connection busy in a transfer is never evicted:
its transfer's own deadline bounds it.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

HANDSHAKING, IDLE, BUSY = "handshaking", "idle", "busy"


@dataclass(slots=True)
class Connection:
    sock: socket.socket
    state: str = HANDSHAKING
    since: float = 0.0  # when it entered its state
    evicted: bool = False


class ConnectionTable:
    """Thread-safe; every method is short and never waits on I/O while holding the lock."""

    def __init__(self, max_connections: int, max_handshaking: int) -> None:
        self.max_connections = max_connections
        self.max_handshaking = max(1, min(max_handshaking, max_connections))
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, Connection] = {}
        self.evicted = 0

    def admit(self, sock: socket.socket) -> Connection | None:
        """A slot for ``sock`` (None: refused). May close another connection for it: the oldest
        handshaking one when peers not yet authenticated hold their share, else the longest idle."""
        with self._lock:
            live = [c for c in self._conns.values() if not c.evicted]
            handshaking = [c for c in live if c.state == HANDSHAKING]
            idle = [c for c in live if c.state == IDLE]
            if len(handshaking) >= self.max_handshaking:
                victim: Connection | None = min(handshaking, key=lambda c: c.since)
            elif len(live) >= self.max_connections:
                victim = min(idle, key=lambda c: c.since) if idle else None
                if victim is None:
                    return None
            else:
                victim = None
            if victim is not None:
                victim.evicted = True
                self.evicted += 1
            conn = self._conns[sock] = Connection(sock, HANDSHAKING, time.monotonic())
        if victim is not None:
            try:
                victim.sock.shutdown(socket.SHUT_RDWR)  # its thread ends and gives the slot back
            except OSError:
                pass
        return conn

    def set_state(self, conn: Connection, state: str) -> bool:
        """Move ``conn`` to ``state``; False when it was evicted (its thread should end). A
        connection already in ``state`` keeps the time it entered it: idle since its handshake
        ended, however late its thread comes back to wait for a transfer."""
        with self._lock:
            if conn.evicted:
                return False
            if conn.state != state:
                conn.state, conn.since = state, time.monotonic()
            return True

    def remove(self, sock: socket.socket) -> Connection | None:
        with self._lock:
            return self._conns.pop(sock, None)

    def sockets(self) -> list[socket.socket]:
        with self._lock:
            return list(self._conns)

    def __len__(self) -> int:
        with self._lock:
            return sum(not c.evicted for c in self._conns.values())
