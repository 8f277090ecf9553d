"""A small JSON-over-HTTP server for the admin endpoint (``connector/admin.py``).

Plain standard library: a request is one JSON body in, one JSON body out. The server runs on
daemon threads, so it never holds up the process's exit, and binds to loopback unless told
otherwise: it has no authentication of its own.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger("vllm.kvlens")

MAX_BODY_BYTES = 64 * 1024
Route = Callable[[dict[str, Any]], tuple[int, dict[str, Any]]]


class AdminServer:
    def __init__(self, host: str, port: int, routes: Mapping[tuple[str, str], Route]) -> None:
        handler = type("_Handler", (_Handler,), {"routes": dict(routes)})
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvlens-admin", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=2.0)


class _Handler(BaseHTTPRequestHandler):
    routes: dict[tuple[str, str], Route] = {}
    server_version = "kvlens-admin"

    def do_GET(self) -> None:  # noqa: N802 - the standard library's name
        self._serve("GET", {})

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self._reply(413, {"error": f"body over {MAX_BODY_BYTES} bytes"})
            return
        raw = self.rfile.read(length) if length else b"{}"
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            self._reply(400, {"error": "the body is not JSON"})
            return
        if not isinstance(body, dict):
            self._reply(400, {"error": "the body must be a JSON object"})
            return
        self._serve("POST", body)

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
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the standard library's name
        logger.debug("KVLens admin: " + format, *args)
