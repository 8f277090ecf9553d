"""Telling the proxy that a prefiller rank's transfer has ended, as LMCache's proxy reads it.

LMCache's example proxy (``examples/disagg_prefill/disagg_proxy_server.py``) binds a ZMQ PULL
socket and decodes each message with ``msgspec.msgpack.decode(b, type=PDMsg)``, ``PDMsg`` being a
union of tagged structs: ``ProxyNotif`` is the map ``{"type": "ProxyNotif", "req_id": ...}``. Every
prefiller rank PUSHes one per transfer, success or not (that proxy waits for it without bound).

A send never blocks past ``send_timeout_s``: with no proxy connected the notice is dropped and
counted (``failed``), and closing waits at most ``linger_s`` for notices still queued.
"""

from __future__ import annotations

import logging
import threading

import msgspec
import zmq

log = logging.getLogger(__name__)


class ProxyNotif(msgspec.Struct, tag=True):
    """Encodes as ``{"type": "ProxyNotif", "req_id": ...}``, LMCache's tagged struct."""

    req_id: str


_encoder = msgspec.msgpack.Encoder()


def encode_notice(req_id: str) -> bytes:
    return _encoder.encode(ProxyNotif(req_id=req_id))


class ProxyNotifier:
    """ZMQ PUSH to ``tcp://host:port``; thread-safe; never raises into the caller."""

    def __init__(self, host: str, port: int, send_timeout_s: float = 2.0, linger_s: float = 1.0) -> None:
        self.endpoint = f"tcp://{_bracketed(host)}:{port}"
        self._lock = threading.Lock()
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDTIMEO, max(0, int(send_timeout_s * 1000)))
        self._socket.setsockopt(zmq.LINGER, max(0, int(linger_s * 1000)))
        self._socket.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for a proxy not (yet) connected
        self._socket.setsockopt(zmq.SNDHWM, 10_000)
        if ":" in host:
            self._socket.setsockopt(zmq.IPV6, 1)
        self._socket.connect(self.endpoint)
        self._closed = False
        self.sent = 0
        self.failed = 0

    def notify(self, req_id: str) -> bool:
        """Send one ``ProxyNotif``; ``False`` (counted, logged) when it could not go out in time."""
        with self._lock:
            if self._closed:
                self.failed += 1
                return False
            try:
                self._socket.send(encode_notice(req_id))
            except zmq.ZMQError as e:
                self.failed += 1
                log.warning("PD proxy notice for %s to %s not sent: %s", req_id, self.endpoint, e)
                return False
            self.sent += 1
            return True

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._socket.close()


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
