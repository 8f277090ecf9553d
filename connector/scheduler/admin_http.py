"""A small JSON-over-HTTP server for the admin endpoint (``connector/scheduler/admin.py``).

Plain standard library: a request is one JSON body in, one JSON body out. It runs inside the
engine-core process, so every request is bounded before anything is read: a bearer token
(``admin_token.py``) checked in constant time, a Host header that is an IP literal, ``localhost``
or the bound host (a web page that rebinds its own name to 127.0.0.1 cannot reach it), a JSON
Content-Type on POST (a page can post ``text/plain`` without a preflight, never
``application/json``), a non-negative Content-Length of at most 64 KiB.

Time: one deadline per connection (``timeout_s``, 10 s) bounds the request line, headers and
body together: every read waits only for the time left, so a byte every few seconds cannot
stretch it as it did a timeout per read. A request cut by it is answered 408 if the socket takes
that without waiting, and closed. Its reply gets a fresh ``timeout_s`` once the route returns
(a clear may wait ~150 s for the engine); refusals share the request's deadline.

Before the token (a header, so the head is read whole first) a connection may send at most
``MAX_HEAD_BYTES``: the standard library alone allows 64 KiB a line and 100 lines, ~6 MiB. No
body is read, no route runs and nothing is sized by its Content-Length until the token is
checked; a refusal discards only what already arrived, never waiting (a close over unread data
would reset the reply).

Slots: at most ``max_handlers`` connections are held at once. When all are taken, a newcomer
takes the place of the oldest whose token is not yet checked (answered 408): nothing tells an
operator from an attacker before the head is read, so no slot can be reserved, but slow clients
cannot keep the operator out, whose head, sent at once, is checked long before eight newer
connections could push it out. Only when every slot holds a checked request is a newcomer
answered 503 at once. Threads are daemons: the server never holds up the process's exit.
"""

from __future__ import annotations

import hmac
import io
import ipaddress
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

logger = logging.getLogger("vllm.kvlens")

MAX_BODY_BYTES = 64 * 1024
MAX_HEAD_BYTES = 16 * 1024  # request line and headers: kvlens sends a few hundred bytes
MAX_HANDLERS = 8  # connections held at once (a clear holds one for up to ~150 s)
REQUEST_TIMEOUT_S = 10.0  # to receive a whole request, and again to write its reply
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
        timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        """``timeout_s`` bounds a whole request's arrival, and then its reply's write."""
        if not token:
            raise ValueError("the admin endpoint needs a token")
        attrs = {"routes": dict(routes), "token": token.encode(), "bound_host": host.lower()}
        handler = type("_Handler", (_Handler,), attrs)
        self._server = _BoundedServer((host, port), handler, _Slots(max_handlers, timeout_s))
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


class _Cut(Exception):
    """A connection answered at once (if its socket takes it without waiting) and closed."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status
        self.why = why


class _Connection:
    """One connection's bounds, shared by its handler thread and the accepting thread."""

    __slots__ = ("sock", "timeout_s", "deadline", "admitted", "head_left")

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self.sock = sock
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.admitted = False  # its token is checked: it is no longer evicted to make room
        self.head_left = MAX_HEAD_BYTES  # what it may still send before its token is checked

    def time_left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self.late()
        return left

    def late(self) -> _Cut:
        if self.deadline == 0.0:
            return _Cut(408, "every connection slot was taken: the oldest without a checked token gave way")
        return _Cut(408, f"the request did not arrive whole within {self.timeout_s:g}s")

    def renew(self) -> None:
        """A fresh ``timeout_s`` for the reply, once its route has returned."""
        self.deadline = time.monotonic() + self.timeout_s


class _Slots:
    """The connections held at once; see the module docstring for who gives way to whom."""

    def __init__(self, size: int, timeout_s: float) -> None:
        self.size = size
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._held: dict[socket.socket, _Connection] = {}  # oldest first

    def take(self, sock: socket.socket) -> _Connection | None:
        """A slot for a new connection (None: every slot holds a checked request)."""
        with self._lock:
            if len(self._held) >= self.size:
                oldest = next((c for c in self._held.values() if not c.admitted), None)
                if oldest is None:
                    return None
                del self._held[oldest.sock]
                oldest.deadline = 0.0  # see _Connection.late
                _wake(oldest.sock)
            conn = self._held[sock] = _Connection(sock, self._timeout_s)
            return conn

    def admit(self, conn: _Connection) -> bool:
        """Its token checked: it keeps its slot (False: it was already pushed out)."""
        with self._lock:
            conn.admitted = self._held.get(conn.sock) is conn
            return conn.admitted

    def release(self, conn: _Connection) -> None:
        with self._lock:
            if self._held.get(conn.sock) is conn:
                del self._held[conn.sock]


def _wake(sock: socket.socket) -> None:
    """End a read another thread waits on (its handler then finds its deadline passed)."""
    try:
        sock.shutdown(socket.SHUT_RD)
    except OSError:
        pass


class _BoundedServer(HTTPServer):
    """A daemon thread per connection, for the connections ``_Slots`` holds; a newcomer for whom
    there is no slot is answered 503 from the accepting thread, without reading its request."""

    request_queue_size = 64  # a burst of connects waits for accept(), not a SYN retry (1 s)

    def __init__(self, address: tuple[str, int], handler: type, slots: _Slots) -> None:
        super().__init__(address, handler)
        self.slots = slots

    def process_request(self, request: Any, client_address: Any) -> None:
        conn = self.slots.take(request)
        if conn is None:
            _answer_at_once(request, 503, f"the admin endpoint serves {self.slots.size} requests at once")
            _warn("KVLens admin: %d requests in progress; answered 503", self.slots.size)
            self.shutdown_request(request)
            return
        thread = threading.Thread(target=self._serve, args=(conn, client_address), daemon=True)
        try:
            thread.start()
        except BaseException:
            self.slots.release(conn)
            raise

    def _serve(self, conn: _Connection, client_address: Any) -> None:
        try:
            self.finish_request(conn, client_address)  # the handler gets the _Connection
        except Exception:  # noqa: BLE001 - one failed connection must not stop the endpoint
            self.handle_error(conn.sock, client_address)
        finally:
            self.slots.release(conn)
            self.shutdown_request(conn.sock)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client gone mid-reply is no news for the engine's stderr."""
        logger.debug("KVLens admin: connection from %s failed", client_address, exc_info=True)


class _Reader(io.RawIOBase):
    """A connection's reads, each waiting only for the time left until its deadline (so a
    readline over many one-byte recvs is bounded as a whole) and, until its token is checked,
    taking no more than what is left of ``MAX_HEAD_BYTES``."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        conn = self._conn
        if not conn.admitted:
            if conn.head_left <= 0:
                raise _Cut(431, f"the request line and headers are over {MAX_HEAD_BYTES} bytes")
            buffer = memoryview(buffer)[: conn.head_left]
        conn.sock.settimeout(conn.time_left())
        try:
            got = conn.sock.recv_into(buffer)
        except TimeoutError:
            raise conn.late() from None
        if got == 0:
            conn.time_left()  # woken by _Slots.take, which moved its deadline to now
        if not conn.admitted:
            conn.head_left -= got
        return got


class _Writer(io.BufferedIOBase):
    """A connection's writes, all within its deadline (sendall's timeout bounds a whole send)."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        left = self._conn.deadline - time.monotonic()
        if left <= 0:  # the standard library drops a connection whose write times out
            raise TimeoutError("the reply was not written in time")
        self._conn.sock.settimeout(left)
        self._conn.sock.sendall(data)
        with memoryview(data) as view:
            return view.nbytes


def _answer_at_once(sock: socket.socket, status: int, why: str) -> None:
    """A short JSON answer sent only if the socket takes it without waiting, then what already
    arrived discarded (a close over unread data resets the connection before the reply is read)."""
    body = json.dumps({"error": why}).encode()
    head = (
        f"HTTP/1.0 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n"
        + ("Retry-After: 5\r\n" if status == 503 else "")
        + "\r\n"
    )
    try:
        sock.setblocking(False)
        sock.send(head.encode() + body)
    except OSError:
        pass
    _discard_arrived(sock)


def _discard_arrived(sock: socket.socket, most: int = MAX_BODY_BYTES) -> None:
    """Read what has already arrived, up to ``most`` bytes, never waiting for more."""
    scratch = bytearray(16 * 1024)
    try:
        sock.setblocking(False)
        while most > 0 and (got := sock.recv_into(scratch)):
            most -= got
    except OSError:
        pass


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
    server: _BoundedServer
    routes: dict[tuple[str, str], Route] = {}
    token: bytes = b""
    bound_host = ""
    server_version = "kvlens-admin"

    def setup(self) -> None:
        """``request`` is the connection's ``_Connection``: reads and writes go through its bounds."""
        self.conn: _Connection = self.request
        self.connection = self.conn.sock
        self.rfile = io.BufferedReader(_Reader(self.conn))
        self.wfile = _Writer(self.conn)

    def handle(self) -> None:
        """One request per connection (HTTP/1.0); one cut short is answered at once and closed."""
        try:
            self.handle_one_request()
        except _Cut as cut:
            _warn(
                "KVLens admin: connection from %s cut (%d): %s", self.client_address[0], cut.status, cut.why
            )
            _answer_at_once(self.connection, cut.status, cut.why)

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
        """Host and token checked before any body is read; then the connection keeps its slot."""
        if not host_allowed(self.headers.get("Host"), self.bound_host):
            host = (self.headers.get("Host") or "")[:80]
            self._refuse(403, f"Host {host!r} is not this endpoint's: use http://127.0.0.1:<port>")
            return False
        scheme, _, given = (self.headers.get("Authorization") or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.token):
            self._refuse(401, "no valid token: send Authorization: Bearer <extra_config.admin_token(_file)>")
            return False
        if not self.server.slots.admit(self.conn):
            raise self.conn.late()
        return True

    def _body(self) -> dict[str, Any] | None:
        length = self._length()
        if length is None:
            return None
        ctype = (self.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if ctype != "application/json":
            self._refuse(415, "send the body as Content-Type: application/json")
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

    def _refuse(self, status: int, why: str) -> None:
        """Answered within the request's deadline; its body is never waited for, only what
        already arrived is discarded."""
        _warn("KVLens admin: refused %s %s (%d): %s", self.command, self.path[:80], status, why)
        self.close_connection = True
        self._reply(status, {"error": why})
        _discard_arrived(self.connection)

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
        self.conn.renew()
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
