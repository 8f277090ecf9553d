"""Stand-ins for vLLM engines in front of which a PD proxy is tested: small HTTP servers with vLLM's
OpenAI API shapes (``/tokenize``, ``/v1/completions`` streaming and not, ``/v1/models``), a fake
prefiller that PUSHes LMCache's ``ProxyNotif`` over ZMQ when told to, and a fake decoder that can
fail or die mid-stream. Each runs on its own event loop thread; every request is recorded.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import uvicorn
import zmq
from aiohttp import web

from bench.lib.ports import free_port

MODEL = "fake-model"


def tokens_of(text: str) -> list[int]:
    return [1] + [10 + sum(map(ord, w)) % 900 for w in text.split()]


def notice_bytes(req_id: str) -> bytes:
    """LMCache's ProxyNotif on the wire, written without any of our structs: a tagged struct is
    the map {"type": <class name>, fields...}."""
    return msgspec.msgpack.encode({"type": "ProxyNotif", "req_id": req_id})


@dataclass
class Seen:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    at: float  # time.monotonic()


@dataclass
class Behaviour:
    notify: str = "at_answer"  # at_answer | never | on_release (when .release is set)
    notify_ranks: int | None = None  # None: one per decoder rank, as the disagg_spec says
    prefill_status: int = 200  # an error status: the prefiller fails with it
    decode_status: int = 200
    decode_die_after: int | None = None  # stream chunks sent before the connection is cut
    first_tok: int = 777
    first_stop: bool = False  # the prefiller's token ends the answer (EOS)
    prefill_delay_s: float = 0.0  # the prefiller answers this late
    release: threading.Event = field(default_factory=threading.Event)


class FakeEngine:
    """One fake vLLM server; ``proxy_notify`` is where its prefills notify (tcp://host:port)."""

    def __init__(
        self,
        name: str,
        proxy_notify: str | None = None,
        behaviour: Behaviour | None = None,
        port: int | None = None,
    ):
        self.name = name
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proxy_notify = proxy_notify
        self.b = behaviour or Behaviour()
        self.seen: list[Seen] = []
        self.notified: list[tuple[str, float]] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"fake-{name}", daemon=True)
        self._zmq = zmq.Context()
        self._push = None
        self._stopping = False
        self._waiters: list[threading.Thread] = []

    def start(self) -> FakeEngine:
        self._thread.start()
        if not self._ready.wait(10):
            raise TimeoutError(f"fake engine {self.name} did not start")
        return self

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._models)
        self._runner = web.AppRunner(app, handle_signals=False)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        self._stopping = True
        self.b.release.set()
        for waiter in self._waiters:
            waiter.join(10)
        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if self._push is not None:
            self._push.close(linger=0)
        self._zmq.term()

    def requests(self, path: str) -> list[Seen]:
        return [s for s in self.seen if s.path == path]

    async def _record(self, request: web.Request) -> dict[str, Any]:
        body = await request.json()
        self.seen.append(Seen(request.path, body, dict(request.headers), time.monotonic()))
        return body

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await self._record(request)
        if "messages" in body:
            text = " ".join(f"{m['role']}: {m['content']}" for m in body["messages"]) + " assistant:"
        else:
            text = body["prompt"]
        toks = tokens_of(text)
        return web.json_response({"tokens": toks, "count": len(toks), "max_model_len": 4096})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._record(request)
        if isinstance(body.get("kv_transfer_params"), dict) and "disagg_spec" in body["kv_transfer_params"]:
            return await self._prefill(body)
        return await self._decode(request, body)

    def _notify(self, req_id: str, ranks: int) -> None:
        if self._push is None:
            self._push = self._zmq.socket(zmq.PUSH)
            self._push.setsockopt(zmq.LINGER, 0)
            self._push.connect(self.proxy_notify)
        for _ in range(ranks):
            self.notified.append((req_id, time.monotonic()))  # before: the proxy may act at once
            self._push.send(notice_bytes(req_id))

    async def _prefill(self, body: dict[str, Any]) -> web.Response:
        until = time.monotonic() + self.b.prefill_delay_s
        while time.monotonic() < until and not self._stopping:  # stop() does not wait for it
            await asyncio.sleep(0.05)
        if self.b.prefill_status != 200:
            err = {"error": {"message": "fake prefill failure", "type": "InternalServerError", "code": 500}}
            return web.json_response(err, status=self.b.prefill_status)
        spec = body["kv_transfer_params"]["disagg_spec"]
        ranks = len(spec["receiver_init_port"]) if self.b.notify_ranks is None else self.b.notify_ranks
        if self.b.notify == "at_answer":
            self._notify(spec["req_id"], ranks)
        elif self.b.notify == "on_release":
            waiter = threading.Thread(
                target=self._notify_when_released, args=(spec["req_id"], ranks), daemon=True
            )
            self._waiters.append(waiter)
            waiter.start()
        choice = {"index": 0, "text": f" t{self.b.first_tok}", "logprobs": None, "stop_reason": None}
        choice["finish_reason"] = "stop" if self.b.first_stop else "length"
        usage = {
            "prompt_tokens": len(body["prompt"]),
            "completion_tokens": 1,
            "total_tokens": len(body["prompt"]) + 1,
        }
        pd = {"role": "sender", "tokens": len(body["prompt"]), "bytes": 1000, "destinations": ranks}
        return web.json_response(
            {
                "id": f"cmpl-{self.name}-{len(self.seen)}",
                "object": "text_completion",
                "created": 1700000000,
                "model": MODEL,
                "choices": [choice],
                "usage": usage,
                "kv_transfer_params": {"first_tok": self.b.first_tok, "kvlens": {"pd": pd}},
            }
        )

    def _notify_when_released(self, req_id: str, ranks: int) -> None:
        self.b.release.wait()
        if not self._stopping:
            self._notify(req_id, ranks)

    async def _decode(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if self.b.decode_status != 200:
            err = {"error": {"message": "fake decode failure", "type": "BadRequestError", "code": 400}}
            return web.json_response(err, status=self.b.decode_status)
        n, prompt = body["max_tokens"], body["prompt"]
        texts = [f" d{i}" for i in range(n)]
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
        common = {
            "id": f"cmpl-dec-{len(self.seen)}",
            "object": "text_completion",
            "created": 1700000001,
            "model": MODEL,
        }
        if not body.get("stream"):
            choice = {
                "index": 0,
                "text": "".join(texts),
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
            pd = {
                "role": "receiver",
                "outcome": "loaded",
                "reason": None,
                "tokens": len(prompt) - 1,
                "bytes": 1000,
            }
            return web.json_response(
                {**common, "choices": [choice], "usage": usage, "kv_transfer_params": {"kvlens": {"pd": pd}}}
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, text in enumerate(texts):
            if self.b.decode_die_after is not None and i >= self.b.decode_die_after:
                request.transport.abort()  # as a killed engine: the connection drops mid-stream
                return resp
            finish = "length" if i == n - 1 else None
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
            await resp.write(
                b"data: " + json.dumps({**common, "choices": [choice], "usage": None}).encode() + b"\n\n"
            )
            await asyncio.sleep(0)
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(
                b"data: " + json.dumps({**common, "choices": [], "usage": usage}).encode() + b"\n\n"
            )
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


class ServedApp:
    """An ASGI app under uvicorn on a free port, in a thread (started and stopped by the test)."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="served-app", daemon=True)

    def start(self) -> ServedApp:
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the app did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(20)


def sse_events(raw: str) -> list[Any]:
    """The data of each server-sent event ("[DONE]" kept as the string)."""
    out = []
    for block in raw.split("\n\n"):
        block = block.strip()
        if block.startswith("data:"):
            data = block[5:].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out
