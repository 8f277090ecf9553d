"""Fixtures for the dashboard tests: a local HTTP server that serves canned /metrics text
(captured from a real vllm serve with KVLens) and failed-load event logs written by KVLens's
own writer, and the app under Streamlit's AppTest."""

from __future__ import annotations

import http.server
import threading
from pathlib import Path

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from telemetry.events import EventLog, load_failed_event

DATA = Path(__file__).resolve().parent / "data"
APP = str(Path(__file__).resolve().parents[2] / "dashboard" / "app.py")


class TextServer:
    """Serves ``self.text`` at every path on 127.0.0.1 (status ``self.status`` with reason
    phrase ``self.reason``, extra ``self.headers``), or ``self.paths[path]`` at a path listed
    there (the query string ignored); ``self.asked`` lists the paths asked for, query included."""

    def __init__(self, text: str = "") -> None:
        self.text, self.status = text, 200
        self.headers: dict[str, str] = {}
        self.reason: str | None = None
        self.paths: dict[str, str] = {}
        self.asked: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                outer.asked.append(self.path)
                body = outer.paths.get(self.path.split("?", 1)[0], outer.text).encode()
                self.send_response(outer.status, outer.reason)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                for name, value in outer.headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            do_POST = do_GET  # noqa: N815

            def log_message(self, *args):
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.endpoint = f"127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def metrics_text() -> str:
    return (DATA / "metrics-kvlens.txt").read_text()


@pytest.fixture
def text_server():
    server = TextServer()
    yield server
    server.close()


def write_events(path: Path, *events: tuple[str, str, int, str]) -> None:
    """(request id, tier, blocks, reason) -> lines in a KVLens event log at ``path``."""
    log = EventLog(str(path))
    for request_id, tier, blocks, reason in events:
        ids = list(range(blocks))
        log.append(load_failed_event(request_id, [tier], ids, blocks * 128, reason, True, "0", "tiny"))


class RawServer:
    """A TCP listener on 127.0.0.1 that answers every connection with ``reply`` (not HTTP) and
    counts the connections it accepted."""

    def __init__(self, reply: bytes = b"") -> None:
        import socket

        self.reply, self.accepted = reply, 0
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.accepted += 1
            with conn:
                conn.sendall(self.reply)

    def close(self) -> None:
        self._sock.close()


@pytest.fixture
def raw_server():
    server = RawServer()
    yield server
    server.close()


@pytest.fixture
def closed_port() -> int:
    from bench.lib.ports import free_port

    return free_port()


def write_requests(path: Path, *requests: tuple[str, str | None, float], max_bytes: int = 10 << 20) -> None:
    """(request id, miss reason or None, ts) -> lines in a KVLens request log at ``path``: 1000
    prompt tokens, 256 of them from KVLens's CPU tier."""
    from telemetry.request_log import RequestLog, request_record

    log = RequestLog(str(path), max_bytes=max_bytes)
    for request_id, reason, ts in requests:
        detail = {"tier": "cpu", "evicted_s_ago": 12.5} if reason == "evicted" else None
        log.append(
            request_record(
                request_id=request_id,
                engine="0",
                model="tiny",
                prompt_tokens=1000,
                vllm_cached_tokens=0,
                kvlens_tokens_by_tier={"cpu": 256},
                lookup_ms=0.2,
                miss_reason=reason,
                miss_detail=detail,
                now=ts,
            )
        )


@pytest.fixture
def app(monkeypatch, tmp_path):
    """A fresh AppTest with the dashboard's environment cleared (set it, then ``.run()``)."""
    for var in (
        "KVLENS_DASHBOARD_METRICS",
        "KVLENS_DASHBOARD_PROMETHEUS",
        "KVLENS_DASHBOARD_EVENTS",
        "KVLENS_EVENT_LOG",
        "KVLENS_DASHBOARD_REQUESTS",
        "KVLENS_REQUEST_LOG",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KVLENS_DASHBOARD_EVENTS", str(tmp_path / "events.jsonl"))
    st.cache_resource.clear()
    yield AppTest.from_file(APP, default_timeout=60)
    st.cache_resource.clear()
