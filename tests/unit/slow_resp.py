"""A stand-in Redis on a loopback port that answers every read only after a delay: how a loaded
host looks to a client, where each round trip (the connection's handshake included) costs time.

It speaks just enough RESP2 for the remote tier's lookup client: every command gets ``+OK``, but
HELLO (an error: no RESP3), PING (``+PONG``) and EXISTS (``:1`` per key). ``connections``
counts the connections accepted.
"""

from __future__ import annotations

import socket
import threading
import time


class SlowResp:
    def __init__(self, delay_s: float = 0.0, port: int = 0) -> None:
        self.delay_s = delay_s
        self.connections = 0
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", port))
        self._listener.listen(16)
        self.port = self._listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            self._open.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        pending = b""
        try:
            while data := conn.recv(1 << 16):
                pending += data
                replies, pending = _answer(pending)
                if replies:
                    time.sleep(self.delay_s)
                    conn.sendall(replies)
        except OSError:
            pass

    def drop_connections(self) -> None:
        """Close every accepted connection, as a restarted server would."""
        for conn in self._open:
            conn.close()
        self._open.clear()

    def close(self) -> None:
        self._listener.close()
        self.drop_connections()


def _answer(buffer: bytes) -> tuple[bytes, bytes]:
    """Replies to the whole commands in ``buffer``, and what is left of it."""
    out = b""
    while True:
        command, rest = _command(buffer)
        if command is None:
            return out, buffer
        buffer = rest
        name = command[0].upper()
        if name == b"HELLO":  # RESP2 only: the client falls back
            out += b"-ERR unknown command 'HELLO'\r\n"
        elif name == b"PING":
            out += b"+PONG\r\n"
        elif name == b"EXISTS":
            out += b":%d\r\n" % (len(command) - 1)
        else:
            out += b"+OK\r\n"


def _command(buffer: bytes) -> tuple[list[bytes] | None, bytes]:
    if not buffer.startswith(b"*") or b"\r\n" not in buffer:
        return None, buffer
    head, rest = buffer.split(b"\r\n", 1)
    args = []
    for _ in range(int(head[1:])):
        if b"\r\n" not in rest:
            return None, buffer
        size_line, rest = rest.split(b"\r\n", 1)
        size = int(size_line[1:])
        if len(rest) < size + 2:
            return None, buffer
        args.append(rest[:size])
        rest = rest[size + 2 :]
    return args, rest
