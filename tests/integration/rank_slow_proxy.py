"""A TCP proxy in front of redis-server that slows one tensor-parallel rank's reads only.

Each rank names its own records (``<digest>.r<rank>``), so a connection whose commands name
``.r<rank>`` keys is that rank's: its large replies (chunk payloads) wait ``delay_s`` each,
while every other connection, and that rank's small replies (existence checks, write
acknowledgements), pass at once. How one rank's slow or congested link to Redis looks.
"""

from __future__ import annotations

import socket
import threading
import time

LARGE = 16 * 1024  # bytes in one read from Redis that count as payload


class RankSlowProxy:
    def __init__(self, target_port: int, rank: int, delay_s: float, host: str = "127.0.0.1") -> None:
        self._target = (host, target_port)
        self._marker = f".r{rank}".encode()
        self.delay_s = delay_s
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, 0))
        self._listener.listen(64)
        self.url = f"redis://{host}:{self._listener.getsockname()[1]}/0"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._target)
            slow = threading.Event()  # set once this connection names the slow rank's keys
            threading.Thread(target=self._pipe, args=(client, server, slow, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, slow, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, slow: threading.Event, up: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 20)
                if not data:
                    break
                if up and self._marker in data:
                    slow.set()
                if not up and slow.is_set() and len(data) >= LARGE:
                    time.sleep(self.delay_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._listener.close()
