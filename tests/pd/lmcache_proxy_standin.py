"""A stand-in for LMCache's example PD proxy (``examples/disagg_prefill/disagg_proxy_server.py``),
written for KVLens's tests: it speaks that proxy's protocol exactly, so tests that pass through it
prove an LMCache user's proxy works with KVLens unchanged. Not a product: no bound on the wait,
no metrics, errors as the original (an exception in the handler).

What it does, as the original does:
- the same flags (``--port --host --prefiller-host --prefiller-port --num-prefillers
  --decoder-host --decoder-port --decoder-init-port --decoder-alloc-port --num-decoders
  --proxy-host --proxy-port``) and the same host/port pairing;
- request ids are a counter (``"1"``, ``"2"``, ...); clients are picked round-robin, the
  tokenizer among prefillers and decoders together;
- ``/tokenize`` (``{"prompt"}`` or ``{"messages"}``), then the prefiller's ``/v1/completions``
  with the token ids, ``max_tokens`` 1 (chat: ``max_completion_tokens`` 1 too), ``stream`` false
  and ``kv_transfer_params {ret_first_tok, disagg_spec}``;
- the head chunk(s) with the prefiller's text, then a wait WITHOUT a bound until one
  ``ProxyNotif`` per decoder rank has arrived (ZMQ PULL, msgspec msgpack, a tagged-struct union);
- the decoder's ``/v1/completions`` with ``prompt + [first_tok]``, ``max_tokens - 1``, streaming,
  without ``kv_transfer_params``; chat chunks converted from completion chunks.

Run: ``python tests/pd/lmcache_proxy_standin.py --port 8000 --prefiller-port 8100 ...``
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import json
import os
from dataclasses import dataclass, field
from typing import Union

import httpx
import msgspec
import uvicorn
import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse


# LMCache's PD messages (pd_backend.py): tagged structs, decoded as a union.
class PDMsgBase(msgspec.Struct, tag=True):
    pass


class AllocRequest(PDMsgBase):
    keys: list[str]
    fmt: int
    shape: list[int]
    dtype: str
    last_chunk_toks: int


class AllocResponse(PDMsgBase):
    already_sent_indexes: list[int]
    remote_indexes: list[int]


class ProxyNotif(PDMsgBase):
    req_id: str


PDMsg = Union[AllocRequest, AllocResponse, ProxyNotif]  # noqa: UP007 - as LMCache writes it


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def strs(text: str) -> list[str]:
    return [x.strip() for x in text.split(",")]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", type=str, default="localhost")
    p.add_argument("--prefiller-host", type=strs, default=["localhost"])
    p.add_argument("--prefiller-port", type=ints, default=[8100])
    p.add_argument("--num-prefillers", type=int, default=1)
    p.add_argument("--decoder-host", type=strs, default=["localhost"])
    p.add_argument("--decoder-port", type=ints, default=[8200])
    p.add_argument("--decoder-init-port", type=ints, default=[8300])
    p.add_argument("--decoder-alloc-port", type=ints, default=[8400])
    p.add_argument("--num-decoders", type=int, default=1)
    p.add_argument("--proxy-host", type=str, default="localhost")
    p.add_argument("--proxy-port", type=int, default=8500)
    return p.parse_args(argv)


def pairs(hosts: list[str], ports: list[int], count: int) -> list[tuple[str, int]]:
    if len(hosts) == 1 and len(ports) == 1:
        return [(hosts[0], ports[0] + i) for i in range(count if count > 1 else 1)]
    if len(hosts) == 1:
        return [(hosts[0], p) for p in ports]
    if len(ports) == 1:
        return [(h, ports[0]) for h in hosts]
    if len(hosts) != len(ports):
        raise ValueError("Length mismatch between hosts and ports lists for pairing")
    return list(zip(hosts, ports, strict=False))


@dataclass
class Client:
    http: httpx.AsyncClient
    host: str | None = None
    init_port: list[int] = field(default_factory=list)
    alloc_port: list[int] = field(default_factory=list)


class StandIn:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.prefillers: list[Client] = []
        self.decoders: list[Client] = []
        self.notified: collections.defaultdict[str, int] = collections.defaultdict(int)
        self.counter = 0
        self.rr = itertools.count()
        self.running = True

    def open(self) -> None:
        a = self.args
        for h, p in pairs(a.prefiller_host, a.prefiller_port, a.num_prefillers):
            self.prefillers.append(Client(httpx.AsyncClient(timeout=None, base_url=f"http://{h}:{p}")))
        counting = len(a.decoder_host) == 1 and len(a.decoder_port) == 1 and a.num_decoders > 1
        for i, (h, p) in enumerate(pairs(a.decoder_host, a.decoder_port, a.num_decoders)):
            step = i if counting else 0
            self.decoders.append(
                Client(
                    httpx.AsyncClient(timeout=None, base_url=f"http://{h}:{p}"),
                    h,
                    [x + step for x in a.decoder_init_port],
                    [x + step for x in a.decoder_alloc_port],
                )
            )

    async def listen(self) -> None:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.PULL)
        sock.bind(f"tcp://{self.args.proxy_host}:{self.args.proxy_port}")
        decoder = msgspec.msgpack.Decoder(PDMsg)
        try:
            while self.running:
                msg = decoder.decode(await sock.recv())
                if isinstance(msg, ProxyNotif):
                    self.notified[msg.req_id] += 1
        finally:
            sock.close(linger=0)
            ctx.term()

    def pick(self) -> tuple[Client, Client, Client]:
        n = next(self.rr)
        everyone = self.prefillers + self.decoders
        return (
            everyone[n % len(everyone)],
            self.prefillers[n % len(self.prefillers)],
            self.decoders[n % len(self.decoders)],
        )

    async def wait_kv_ready(self, req_id: str, ranks: int) -> None:
        while self.notified[req_id] < ranks:  # no bound: as LMCache's proxy
            await asyncio.sleep(0.0001)
        self.notified.pop(req_id)


def headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY')}"}


async def post_json(client: httpx.AsyncClient, path: str, body: dict) -> dict:
    resp = await client.post(path, json=body, headers=headers())
    resp.raise_for_status()
    return resp.json()


async def stream(client: httpx.AsyncClient, path: str, body: dict):
    async with client.stream("POST", path, json=body, headers=headers()) as resp:
        resp.raise_for_status()
        async for chunk in resp.aiter_bytes():
            yield chunk


def event(data: dict) -> bytes:
    return ("data: " + json.dumps(data, separators=(",", ":")) + "\n\n").encode()


def build_app(args: argparse.Namespace) -> FastAPI:
    proxy = StandIn(args)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        proxy.open()
        task = asyncio.create_task(proxy.listen())
        yield
        proxy.running = False
        task.cancel()
        for c in proxy.prefillers + proxy.decoders:
            await c.http.aclose()

    app = FastAPI(lifespan=lifespan)

    async def prepare(request: Request, chat: bool):
        proxy.counter += 1
        req_id = str(proxy.counter)
        data = await request.json()
        tokenizer, prefiller, decoder = proxy.pick()
        tok_body = {"messages": data["messages"]} if chat else {"prompt": data["prompt"]}
        tokens = (await post_json(tokenizer.http, "/tokenize", tok_body))["tokens"]
        max_tokens = data["max_tokens"]
        data["prompt"] = tokens
        data["max_tokens"] = 1
        max_completion = data.get("max_completion_tokens") if chat else None
        if chat and "max_completion_tokens" in data:
            data["max_completion_tokens"] = 1
        spec = {
            "req_id": req_id,
            "receiver_host": decoder.host,
            "receiver_init_port": decoder.init_port,
            "receiver_alloc_port": decoder.alloc_port,
        }
        data["kv_transfer_params"] = {"ret_first_tok": True, "disagg_spec": spec}
        data["stream"] = False
        stream_options = data.pop("stream_options", None)
        prefill = await post_json(prefiller.http, "/v1/completions", data)
        data["max_tokens"] = max_tokens - 1
        if max_completion is not None:
            data["max_completion_tokens"] = max_completion - 1
        data["prompt"].append(prefill["kv_transfer_params"]["first_tok"])
        data.pop("kv_transfer_params")
        data["stream"] = True
        if stream_options is not None:
            data["stream_options"] = stream_options
        return req_id, len(decoder.init_port), decoder, prefill, data

    @app.post("/v1/completions")
    async def completions(request: Request):
        req_id, ranks, decoder, prefill, data = await prepare(request, chat=False)

        async def body():
            choice = {"index": 0, "text": prefill["choices"][0]["text"], "logprobs": None}
            choice.update(finish_reason=None, stop_reason=None)
            head = {"id": prefill["id"], "object": "text_completion", "created": prefill["created"]}
            head.update(model=prefill["model"], choices=[choice], usage=None)
            yield event(head)
            await proxy.wait_kv_ready(req_id, ranks)
            async for chunk in stream(decoder.http, "/v1/completions", data):
                yield chunk

        return StreamingResponse(body(), media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req_id, ranks, decoder, prefill, data = await prepare(request, chat=True)
        common = {"id": prefill["id"], "object": "chat.completion.chunk", "created": prefill["created"]}
        common["model"] = prefill["model"]

        def chunk_of(delta: dict, logprobs=None, finish=None) -> dict:
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return {**common, "choices": [choice]}

        async def body():
            yield event(chunk_of({"role": "assistant", "content": ""}))
            yield event(chunk_of({"content": prefill["choices"][0]["text"]}))
            await proxy.wait_kv_ready(req_id, ranks)
            async for chunk in stream(decoder.http, "/v1/completions", data):
                text = chunk.decode("utf-8")
                if not text.startswith("data: ") or text.startswith("data: [DONE]"):
                    yield chunk
                    continue
                try:
                    payload = text[6:].strip()
                    if not payload:
                        continue
                    c = json.loads(payload)
                    first = c["choices"][0]
                    converted = chunk_of(
                        {"content": first["text"]}, first.get("logprobs"), first.get("finish_reason")
                    )
                    converted.update(id=c["id"], created=c["created"], model=c["model"])
                    yield event(converted)
                except (json.JSONDecodeError, KeyError, IndexError):
                    yield chunk

        return StreamingResponse(body(), media_type="application/json")

    return app


def main(argv=None) -> None:
    args = parse_args(argv)
    uvicorn.run(build_app(args), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
