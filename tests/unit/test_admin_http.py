"""The admin endpoint's door: token, Host, Content-Type, Content-Length, checked with real HTTP
clients against the server on 127.0.0.1 (its time and slot bounds: test_admin_http_deadline.py)."""

import json
import os
import socket
import stat
import urllib.error
import urllib.request

import pytest

from connector.config.loading import ConfigError, load_config
from connector.scheduler.admin_http import MAX_BODY_BYTES, AdminServer, host_allowed
from connector.scheduler.admin_token import client_token, default_path, engine_token

TOKEN = "t0ken-for-the-admin-endpoint-tests"


@pytest.fixture
def server():
    calls = []

    def clear(body):
        calls.append(body)
        return 200, {"cleared": body}

    srv = AdminServer(
        "127.0.0.1",
        0,
        {("POST", "/kvlens/clear"): clear, ("GET", "/kvlens/namespaces"): lambda b: (200, {"ns": []})},
        TOKEN,
    )
    srv.calls = calls
    try:
        yield srv
    finally:
        srv.close()


def call(srv, path, body=None, headers=None, data=None):
    """(status, reply) of one request through urllib."""
    if body is not None:
        data = json.dumps(body).encode()
    request = urllib.request.Request(srv.url + path, data=data, method="POST" if data is not None else "GET")
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def raw(port, head: bytes, timeout=5.0) -> bytes:
    """Send ``head`` and keep the connection open for writing: the reply, whatever the server
    sent until it closed (a server that waits for more times the client out: TimeoutError)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


def test_only_a_request_with_the_token_is_served(server):
    assert call(server, "/kvlens/namespaces")[0] == 401
    assert call(server, "/kvlens/clear", {"all": True}, {"Content-Type": "application/json"})[0] == 401
    wrong = {**AUTH, "Authorization": "Bearer " + TOKEN[:-1] + "X"}
    assert call(server, "/kvlens/clear", {"all": True}, wrong)[0] == 401
    assert call(server, "/kvlens/clear", {"all": True}, {**AUTH, "Authorization": TOKEN})[0] == 401
    assert server.calls == []
    assert call(server, "/kvlens/namespaces", headers=AUTH) == (200, {"ns": []})
    assert call(server, "/kvlens/clear", {"all": True}, AUTH) == (200, {"cleared": {"all": True}})
    assert server.calls == [{"all": True}]


def test_a_post_that_is_not_json_is_refused_as_a_web_page_would_send_it(server):
    """A page may post text/plain to loopback without a CORS preflight; never application/json."""
    status, reply = call(
        server, "/kvlens/clear", headers={**AUTH, "Content-Type": "text/plain"}, data=b'{"all": true}'
    )
    assert status == 415 and "application/json" in reply["error"]
    assert (
        call(server, "/kvlens/clear", headers={"Authorization": AUTH["Authorization"]}, data=b"{}")[0] == 415
    )
    assert server.calls == []


def test_a_host_header_of_another_name_is_refused(server):
    """DNS rebinding: a page's own name resolved to 127.0.0.1 carries that name in Host."""
    status, reply = call(server, "/kvlens/clear", {"all": True}, {**AUTH, "Host": "attacker.example:80"})
    assert status == 403 and "Host" in reply["error"]
    assert server.calls == []
    port = server.port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "[::1]", "127.0.0.1"):
        assert call(server, "/kvlens/namespaces", headers={**AUTH, "Host": host})[0] == 200, host


def test_host_names_a_page_cannot_choose_are_allowed():
    assert host_allowed("10.0.0.5:8000", "0.0.0.0") and host_allowed("[fe80::1]:1", "127.0.0.1")
    assert host_allowed("admin.internal:9000", "admin.internal")
    assert not host_allowed("127.0.0.1.attacker.example", "127.0.0.1")
    assert not host_allowed(None, "127.0.0.1") and not host_allowed("", "127.0.0.1")


def test_a_negative_content_length_is_answered_at_once_without_reading(server):
    """rfile.read(-1) would buffer until the client closes, inside the engine-core process."""
    head = (
        f"POST /kvlens/clear HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
        "Content-Type: application/json\r\nContent-Length: -1\r\n\r\n"
    ).encode()
    reply = raw(server.port, head + b"x" * 65536)  # the client keeps sending and never closes
    assert reply.startswith(b"HTTP/1.0 400") and b"non-negative integer" in reply
    assert server.calls == []


@pytest.mark.parametrize(
    "length_header, status",
    [("", 411), ("Content-Length: abc\r\n", 400), ("Content-Length: +5\r\n", 400),
     (f"Content-Length: {MAX_BODY_BYTES + 1}\r\n", 413), ("Content-Length: 99999999999999999999\r\n", 400),
     ("Transfer-Encoding: chunked\r\n", 411)],
)  # fmt: skip
def test_a_post_without_a_bounded_length_is_refused_before_its_body(server, length_header, status):
    head = (
        f"POST /kvlens/clear HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Type: application/json\r\n{length_header}\r\n"
    ).encode()
    assert raw(server.port, head).startswith(f"HTTP/1.0 {status}".encode())
    assert server.calls == []


def test_an_engine_without_a_configured_token_writes_a_new_one_only_its_user_reads(monkeypatch, tmp_path):
    monkeypatch.setenv("KVLENS_ADMIN_TOKEN_DIR", str(tmp_path / "run"))
    monkeypatch.delenv("KVLENS_ADMIN_TOKEN", raising=False)
    first, where = engine_token(None, None, 7001)
    assert where == str(default_path(7001)) and len(first) >= 32
    assert stat.S_IMODE(os.stat(where).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "run").st_mode) == 0o700
    assert client_token("http://127.0.0.1:7001") == first
    second, _ = engine_token(None, None, 7001)
    assert second != first and client_token("http://127.0.0.1:7001/") == second  # one per start
    assert client_token("http://127.0.0.1:7002") is None
    assert client_token("http://localhost:7001") == second
    assert client_token("http://10.1.2.3:7001") is None  # another host: never this host's token
    assert client_token("http://127.0.0.1:7001", env={"KVLENS_ADMIN_TOKEN": "from-env"}) == "from-env"


def test_a_configured_token_file_is_read_or_written_once(tmp_path):
    path = tmp_path / "admin.token"
    token, where = engine_token(None, str(path), 7001)
    assert where == str(path) and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert engine_token(None, str(path), 7002)[0] == token  # a second engine of the deployment
    assert client_token("http://127.0.0.1:7002", str(path)) == token
    assert engine_token("x" * 16, None, 7001) == ("x" * 16, "extra_config.admin_token")


def test_a_token_and_a_token_file_together_are_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="admin_token"):
        load_config(
            {"lmcache.extra_config.admin_token": "x" * 16, "lmcache.extra_config.admin_token_file": "f"},
            env={},
        )
    with pytest.raises(ConfigError, match="admin_token"):
        load_config({"lmcache.extra_config.admin_token": "short"}, env={})
    config = load_config({"lmcache.extra_config.admin_token": "y" * 20}, env={})
    assert "y" * 20 not in json.dumps(config.summary())
