"""A TCP proxy in front of redis-server that can make the network slow for large replies only.

Chunk payloads (hundreds of KB) are delayed while existence checks and pings (a few bytes)
pass at once, so a lookup finds a chunk and its load then waits: how a congested link or an
overloaded Redis looks to KVLens, with nothing injected into KVLens itself.

With ``rank`` set, only one tensor-parallel rank's link is slow: each rank names its own records
(``<digest>.r<rank>``), so a connection whose commands name ``.r<rank>`` keys is that rank's,
and only its large replies wait; every other connection passes at once.
"""

from __future__ import annotations

import socket
import threading
import time

LARGE = 16 * 1024  # bytes in one read from Redis that count as payload


class SlowProxy:
    def __init__(
        self, target_port: int, host: str = "127.0.0.1", rank: int | None = None, delay_s: float = 0.0
    ) -> None:
        self._target = (host, target_port)
        self._marker = None if rank is None else f".r{rank}".encode()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self.url = f"redis://{host}:{self.port}/0"
        self.delay_s = delay_s  # added before forwarding each large read from Redis
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._target)
            slow = threading.Event()  # set: this connection's large replies wait
            if self._marker is None:
                slow.set()
            threading.Thread(target=self._pipe, args=(client, server, False, slow), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True, slow), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, from_redis: bool, slow: threading.Event) -> None:
        try:
            while True:
                data = src.recv(1 << 20)
                if not data:
                    break
                if not from_redis and self._marker is not None and self._marker in data:
                    slow.set()  # the slow rank's connection
                if from_redis and self.delay_s and slow.is_set() and len(data) >= LARGE:
                    time.sleep(self.delay_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
