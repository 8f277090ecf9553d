"""The admin endpoint's time and slot bounds against clients that trickle: one deadline for a whole
request however its bytes arrive, a bounded head, nothing read or run before the token, and slow
clients without the token unable to keep the operator out. Real sockets on 127.0.0.1, with a
1 s deadline through the constructor."""

import inspect
import json
import socket
import threading
import time
from pathlib import Path

from connector.scheduler import admin_http
from connector.scheduler.admin_http import AdminServer

from .test_admin_http import AUTH, TOKEN, call

DEADLINE_S = 1.0
MARGIN_S = 1.5  # a loaded two-core machine
DOCS = Path(__file__).resolve().parents[2] / "docs" / "operating.md"


class Trickle:
    """A client that sends ``head``, then one byte every ``every`` seconds, never finishing."""

    def __init__(self, port: int, head: bytes, every: float = 0.3) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.sendall(head)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drip, args=(every,), daemon=True)
        self._thread.start()

    def _drip(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                self.sock.send(b"a")
            except OSError:
                return

    def closed_within(self, limit: float) -> tuple[float | None, bytes]:
        """(seconds until the server closed the connection, None if it did not; what it sent)."""
        start, got = time.monotonic(), b""
        self.sock.settimeout(limit)
        try:
            while chunk := self.sock.recv(65536):
                got += chunk
        except TimeoutError:
            return None, got
        except ConnectionResetError:
            pass
        return time.monotonic() - start, got

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


def start(routes=None, **kwargs) -> AdminServer:
    routes = routes or {("GET", "/kvlens/namespaces"): lambda b: (200, {"ns": []})}
    return AdminServer("127.0.0.1", 0, routes, TOKEN, timeout_s=DEADLINE_S, **kwargs)


BEARER = f"Authorization: Bearer {TOKEN}"
HEAD = b"GET /kvlens/namespaces HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "  # one header line, never ended


def test_an_operator_gets_through_while_every_slot_trickles_a_head():
    """Slow clients without the token give way to a newcomer: the operator's request is served at
    once, not answered 503 for as long as they trickle."""
    srv = start()
    slow = [Trickle(srv.port, HEAD) for _ in range(admin_http.MAX_HANDLERS)]
    try:
        time.sleep(0.5)  # every slot taken, every trickle under way
        began = time.monotonic()
        assert call(srv, "/kvlens/namespaces", headers=AUTH) == (200, {"ns": []})
        assert time.monotonic() - began < DEADLINE_S
        assert all(trickle.closed_within(MARGIN_S)[0] is not None for trickle in slow)  # 408, or gave way
    finally:
        for trickle in slow:
            trickle.stop()
        srv.close()


def test_a_head_trickled_byte_by_byte_is_closed_at_the_deadline():
    """One readline over many one-byte recvs: a timeout per read would never fire."""
    srv = start()
    trickle = Trickle(srv.port, HEAD)
    try:
        closed_after, got = trickle.closed_within(DEADLINE_S + MARGIN_S)
        assert closed_after is not None, "still open past the deadline"
        assert got == b"" or got.startswith(b"HTTP/1.0 408")
    finally:
        trickle.stop()
        srv.close()


def test_a_body_trickled_byte_by_byte_is_cut_at_the_deadline():
    calls = []
    srv = start({("POST", "/kvlens/clear"): lambda b: (calls.append(b), (200, {}))[1]})
    head = (
        f"POST /kvlens/clear HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
        "Content-Type: application/json\r\nContent-Length: 40\r\n\r\n"
    ).encode()
    trickle = Trickle(srv.port, head + b'{"all": true, "pad": "')
    try:
        closed_after, got = trickle.closed_within(DEADLINE_S + MARGIN_S)
        assert closed_after is not None, "still reading the body past the deadline"
        assert got == b"" or got.startswith(b"HTTP/1.0 408")
        assert calls == []
    finally:
        trickle.stop()
        srv.close()


def test_a_connection_that_stops_sending_is_answered_408_and_closed_at_the_deadline():
    srv = start()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            start_s = time.monotonic()
            sock.sendall(b"POST /kvlens/clear HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.0 408") and b"within 1s" in reply
        assert DEADLINE_S * 0.9 < time.monotonic() - start_s < DEADLINE_S + MARGIN_S
    finally:
        srv.close()


def test_without_the_token_the_body_is_never_waited_for():
    """A request without the token costs only its head: the 401 comes before the body it
    announces (which never comes), not at the deadline."""
    calls = []
    srv = AdminServer("127.0.0.1", 0, {("POST", "/kvlens/clear"): calls.append}, TOKEN, timeout_s=5.0)
    head = (
        b"POST /kvlens/clear HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 60000\r\n\r\n"
    )
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            start_s = time.monotonic()
            sock.sendall(head)
            first = sock.recv(65536)
            assert time.monotonic() - start_s < 1.0
        assert first.startswith(b"HTTP/1.0 401") and calls == []
    finally:
        srv.close()


def test_a_head_over_the_limit_is_answered_431_before_anything_runs():
    calls = []
    srv = start({("GET", "/kvlens/namespaces"): lambda b: (calls.append(b), (200, {}))[1]})
    head = (
        f"GET /kvlens/namespaces HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"X-Pad: {'p' * admin_http.MAX_HEAD_BYTES}\r\n\r\n"
    ).encode()
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            sock.sendall(head)
            reply = sock.recv(65536)
        assert reply.startswith(b"HTTP/1.0 431") and calls == []
    finally:
        srv.close()


def test_a_reply_nobody_reads_frees_its_slot_at_the_deadline():
    big = {"pad": "x" * (32 << 20)}  # more than the socket buffers hold
    srv = start(
        {("GET", "/kvlens/namespaces"): lambda b: (200, big), ("GET", "/ok"): lambda b: (200, {})},
        max_handlers=1,
    )
    stuck = socket.socket()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        stuck.connect(("127.0.0.1", srv.port))
        stuck.sendall(f"GET /kvlens/namespaces HTTP/1.0\r\nHost: 127.0.0.1\r\n{BEARER}\r\n\r\n".encode())
        time.sleep(0.3)  # its reply is being written, to nobody
        began, statuses = time.monotonic(), []
        while time.monotonic() - began < DEADLINE_S + MARGIN_S and 200 not in statuses:
            statuses.append(call(srv, "/ok", headers=AUTH)[0])
            time.sleep(0.1)
        assert statuses[0] == 503 and statuses[-1] == 200
    finally:
        stuck.close()
        srv.close()


def test_requests_beyond_the_slots_are_answered_503_once_every_slot_holds_a_checked_one():
    release, entered = threading.Event(), threading.Semaphore(0)

    def wait(_body):
        entered.release()
        release.wait(10)
        return 200, {}

    srv = start({("GET", "/wait"): wait, ("GET", "/ok"): lambda b: (200, {})}, max_handlers=2)
    statuses = []
    held = [
        threading.Thread(target=lambda: statuses.append(call(srv, "/wait", headers=AUTH)[0]))
        for _ in range(2)
    ]
    try:
        for thread in held:
            thread.start()
        assert entered.acquire(timeout=5) and entered.acquire(timeout=5)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as third:
            busy = third.recv(65536)
        assert busy.startswith(b"HTTP/1.0 503") and b"Retry-After: 5" in busy
        assert json.loads(busy.split(b"\r\n\r\n", 1)[1])["error"].startswith("the admin endpoint serves 2")
    finally:
        release.set()
        for thread in held:
            thread.join(timeout=10)
    try:
        assert statuses == [200, 200]
        assert call(srv, "/ok", headers=AUTH)[0] == 200
    finally:
        srv.close()


def test_the_documented_bounds_are_the_defaults():
    """docs/operating.md states what a user gets: a 10 s deadline, 8 connections, a 16 KiB head."""
    defaults = inspect.signature(AdminServer).parameters
    assert defaults["timeout_s"].default == admin_http.REQUEST_TIMEOUT_S == 10.0
    assert defaults["max_handlers"].default == admin_http.MAX_HANDLERS == 8
    assert admin_http.MAX_HEAD_BYTES == 16 * 1024
    text = " ".join(DOCS.read_text().split())
    assert "headers over 16 KiB (431)" in text
    assert "within 10 s of its connection" in text and "its reply is written within 10 s" in text
    assert "At most 8 connections are held at once" in text
