"""A loopback TCP relay in front of a real redis-server that can stall or cut replies mid-value.

Client bytes go through untouched; server bytes are relayed until the relay's ``limit`` of them
(counted over all connections from the moment it is set), then held back (``stall``) or the
client's connection is closed (``cut``). ``release`` lets everything through again.
"""

from __future__ import annotations

import socket
import threading


class Relay:
    def __init__(self, port: int) -> None:
        self._target = ("127.0.0.1", port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Condition()
        self._left: int | None = None  # server bytes still relayed; None: no limit
        self._cut = False
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stall(self, after: int) -> None:
        with self._lock:
            self._left, self._cut = after, False

    def cut(self, after: int) -> None:
        with self._lock:
            self._left, self._cut = after, True

    def release(self) -> None:
        with self._lock:
            self._left = None
            self._lock.notify_all()

    def close(self) -> None:
        self._closed = True
        self.release()
        self._listener.close()
        for s in self._sockets:
            s.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._target)
            self._sockets += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, limited: bool) -> None:
        try:
            while data := src.recv(65536):
                if limited:
                    data = self._allowed(data, dst)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _allowed(self, data: bytes, dst: socket.socket) -> bytes:
        """Relays what the limit lets through; waits (stall) or closes (cut) at the limit."""
        with self._lock:
            if self._left is None:
                return data
            head, self._left = data[: self._left], self._left - min(len(data), self._left)
            if len(head) == len(data):
                return data
        dst.sendall(head)
        with self._lock:
            if self._cut:
                raise OSError("cut")
            while self._left is not None and not self._closed:
                self._lock.wait()
        return data[len(head) :]
