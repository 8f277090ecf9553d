"""A small JSON-over-HTTP server for the admin endpoint (``connector/scheduler/admin.py``).

Plain standard library: a request is one JSON body in, one JSON body out. It runs inside the
engine-core process, so every request is bounded before anything is read: a bearer token
(``admin_token.py``) checked in constant time, a Host header that is an IP literal, ``localhost``
or the bound host (a web page that rebinds its own name to 127.0.0.1 cannot reach it), a JSON
Content-Type on POST (a page can post ``text/plain`` without a preflight, never
``application/json``), a non-negative Content-Length of at most 64 KiB, a socket timeout per
connection and at most ``MAX_HANDLERS`` connections served at once (more are answered 503 at
once). The server runs on daemon threads, so it never holds up the process's exit.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger("vllm.kvlens")

MAX_BODY_BYTES = 64 * 1024
MAX_HANDLERS = 8  # connections served at once (a clear holds one for up to ~150 s)
SOCKET_TIMEOUT_S = 10.0  # longest wait on one read or write of a connection
Route = Callable[[dict[str, Any]], tuple[int, dict[str, Any]]]
_DIGITS = re.compile(r"[0-9]{1,12}")
WARN_EVERY_S = 10.0  # refusals beyond one warning in this time are logged at debug level
_warned_at = [-WARN_EVERY_S]


def _warn(text: str, *args: Any) -> None:
    """A refusal, said at most once per WARN_EVERY_S (a flood of them must not flood the log)."""
    now = time.monotonic()
    if now - _warned_at[0] >= WARN_EVERY_S:
        _warned_at[0] = now
        logger.warning(text + " (more within %gs at debug level)", *args, WARN_EVERY_S)
    else:
        logger.debug(text, *args)


class AdminServer:
    def __init__(
        self,
        host: str,
        port: int,
        routes: Mapping[tuple[str, str], Route],
        token: str,
        max_handlers: int = MAX_HANDLERS,
        timeout_s: float = SOCKET_TIMEOUT_S,
    ) -> None:
        if not token:
            raise ValueError("the admin endpoint needs a token")
        attrs = {
            "routes": dict(routes),
            "token": token.encode(),
            "bound_host": host.lower(),
            "timeout": timeout_s,
        }
        handler = type("_Handler", (_Handler,), attrs)
        self._server = _BoundedServer((host, port), handler, max_handlers)
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvlens-admin", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=2.0)


class _BoundedServer(ThreadingHTTPServer):
    """One thread per connection, at most ``max_handlers`` at once: beyond, 503 from the
    accepting thread without reading the request."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, max_handlers: int) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_handlers)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            _answer_busy(request)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _answer_busy(sock: socket.socket) -> None:
    body = json.dumps({"error": f"the admin endpoint serves {MAX_HANDLERS} connections at once"}).encode()
    head = (
        "HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 5\r\nConnection: close\r\n\r\n"
    )
    try:
        sock.settimeout(1.0)
        sock.sendall(head.encode() + body)
        sock.setblocking(False)
        sock.recv(MAX_BODY_BYTES)  # what already arrived: a close over unread data resets the reply
    except OSError:
        pass
    _warn("KVLens admin: over %d connections at once; answered 503", MAX_HANDLERS)


def host_allowed(header: str | None, bound_host: str) -> bool:
    """A Host header no DNS name of a web page's choosing can produce: an IP literal,
    ``localhost``, this machine's name or the host the endpoint is bound to."""
    if not header:
        return False
    name = header.strip().lower()
    if name.startswith("["):
        name = name[1 : name.find("]")] if "]" in name else ""
    elif name.count(":") == 1:
        name = name.split(":", 1)[0]
    name = name.rstrip(".")
    if name and name in ("localhost", bound_host, socket.gethostname().lower()):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class _Handler(BaseHTTPRequestHandler):
    routes: dict[tuple[str, str], Route] = {}
    token: bytes = b""
    bound_host = ""
    server_version = "kvlens-admin"
    timeout = SOCKET_TIMEOUT_S

    def do_GET(self) -> None:  # noqa: N802 - the standard library's name
        if self._admitted():
            self._serve("GET", {})

    def do_POST(self) -> None:  # noqa: N802
        if not self._admitted():
            return
        body = self._body()
        if body is not None:
            self._serve("POST", body)

    def _admitted(self) -> bool:
        """Host and token checked before any body is read."""
        if not host_allowed(self.headers.get("Host"), self.bound_host):
            host = (self.headers.get("Host") or "")[:80]
            self._refuse(403, f"Host {host!r} is not this endpoint's: use http://127.0.0.1:<port>")
            return False
        scheme, _, given = (self.headers.get("Authorization") or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.token):
            self._refuse(401, "no valid token: send Authorization: Bearer <extra_config.admin_token(_file)>")
            return False
        return True

    def _body(self) -> dict[str, Any] | None:
        length = self._length()
        if length is None:
            return None
        ctype = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if ctype != "application/json":
            self._refuse(415, "send the body as Content-Type: application/json", length)
            return None
        raw = self.rfile.read(length) if length else b"{}"
        if len(raw) < length:
            self._refuse(400, "the body is shorter than its Content-Length")
            return None
        try:
            body = json.loads(raw)
        except ValueError:
            self._refuse(400, "the body is not JSON")
            return None
        if not isinstance(body, dict):
            self._refuse(400, "the body must be a JSON object")
            return None
        return body

    def _length(self) -> int | None:
        """The body's Content-Length (None: refused): a non-negative integer within the limit."""
        if self.headers.get("Transfer-Encoding"):
            self._refuse(411, "send a Content-Length, not a chunked body")
            return None
        given = self.headers.get_all("Content-Length") or []
        if not given:
            self._refuse(411, "a POST needs a Content-Length")
            return None
        text = given[0].strip()
        if len(set(given)) != 1 or not _DIGITS.fullmatch(text):
            self._refuse(400, f"Content-Length must be one non-negative integer, got {text[:20]!r}")
            return None
        if int(text) > MAX_BODY_BYTES:
            self._refuse(413, f"body over {MAX_BODY_BYTES} bytes")
            return None
        return int(text)

    def _refuse(self, status: int, why: str, unread: int = 0) -> None:
        _warn("KVLens admin: refused %s %s (%d): %s", self.command, self.path[:80], status, why)
        if status in (401, 403) and self.command == "POST":
            unread = _small_length(self.headers.get("Content-Length"))
        if unread:  # a close over unread data resets the connection before the reply is read
            try:
                self.rfile.read(unread)
            except OSError:
                pass
        self.close_connection = True
        self._reply(status, {"error": why})

    def _serve(self, method: str, body: dict[str, Any]) -> None:
        route = self.routes.get((method, self.path.split("?", 1)[0]))
        if route is None:
            known = sorted(f"{m} {p}" for m, p in self.routes)
            self._reply(404, {"error": f"no {method} {self.path}; this endpoint serves {', '.join(known)}"})
            return
        try:
            status, reply = route(body)
        except ValueError as e:
            status, reply = 400, {"error": str(e)}
        except Exception as e:  # noqa: BLE001 - one failed request must not stop the endpoint
            logger.warning("KVLens admin %s %s failed: %s", method, self.path, e, exc_info=True)
            status, reply = 500, {"error": f"{type(e).__name__}: {e}"}
        self._reply(status, reply)

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", 'Bearer realm="kvlens-admin"')
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the standard library's name
        logger.debug("KVLens admin: " + format, *args)


def _small_length(value: str | None) -> int:
    text = (value or "").strip()
    return int(text) if _DIGITS.fullmatch(text) and int(text) <= MAX_BODY_BYTES else 0
