"""``kvlens pd-proxy``: an OpenAI-compatible proxy in front of prefillers and decoders, speaking
LMCache's example proxy's protocol (its flags too, so it replaces it as it is), plus what that
proxy lacks: a bounded wait for the prefillers' notifications, the trace passed on, its own
``/metrics``, a record per request, and a backend's errors passed to the client, never a hang.

A request: tokenize at the prefiller (``/tokenize``), ask the prefiller for one token with
``kv_transfer_params {ret_first_tok, disagg_spec}`` (the first token goes to a streaming client at
once), wait until every decoder rank's ``ProxyNotif`` arrived or ``--notify-timeout`` passed, ask
the decoder for the rest with ``prompt + [first token]`` (it loads the prompt's KV from its PD
buffer, or recomputes what is not there). Details: docs/disaggregation.md, "The proxy".
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from . import answers
from . import requests as reqs
from .backends import Backend, ProxySettings, RoundRobin
from .flow import Flow
from .notices import NoticeBoard, NoticeListener
from .observe import ProxyMetrics, RecordLog, Tracer

logger = logging.getLogger(__name__)
WARN_EVERY_S = 60.0
SSE = "text/event-stream"


class BackendFailed(Exception):
    """A backend answered with an error, or not at all: the status and body for the client."""

    def __init__(self, status: int, body: dict[str, Any], why: str) -> None:
        super().__init__(why)
        self.status, self.body = status, body


class PDProxy:
    """The proxy's state: backends, the notification board and listener, metrics, records."""

    def __init__(
        self, settings: ProxySettings, tracer_provider: Any = None, registry: CollectorRegistry | None = None
    ):
        problems = settings.problems()
        if problems:
            raise ValueError("; ".join(problems))
        self.settings = settings
        self.router = RoundRobin([] if settings.no_pd else settings.prefillers(), settings.decoders())
        self.metrics = ProxyMetrics(registry)
        self.board = NoticeBoard(self.metrics.stray.inc, self.metrics.malformed.inc)
        self.listener = (
            None if settings.no_pd else NoticeListener(self.board, settings.proxy_host, settings.proxy_port)
        )
        self.records = RecordLog(settings.records, settings.request_log)
        self._warned_at = -WARN_EVERY_S
        self.tracer = Tracer(tracer_provider)
        self.client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        timeout = httpx.Timeout(
            self.settings.backend_timeout_s, connect=min(10.0, self.settings.backend_timeout_s)
        )
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)
        if self.listener is not None:
            self.listener.start()

    async def close(self) -> None:
        if self.listener is not None:
            await self.listener.close()
        if self.client is not None:
            await self.client.aclose()
        self.records.close()
        self.tracer.shutdown()

    # ---- backend calls ---------------------------------------------------------------------------
    async def post(
        self, backend: Backend, path: str, body: dict[str, Any], headers: dict[str, str], role: str
    ):
        assert self.client is not None
        try:
            resp = await self.client.post(backend.url + path, json=body, headers=headers)
        except httpx.TimeoutException as e:
            raise self._failed(
                504, role, backend, f"no answer within {self.settings.backend_timeout_s:g} s ({e!r})"
            ) from e
        except httpx.HTTPError as e:
            raise self._failed(502, role, backend, f"unreachable ({type(e).__name__}: {e})") from e
        if resp.status_code >= 400:
            why = f"{role} {backend.name} answered HTTP {resp.status_code}"
            raise BackendFailed(resp.status_code, answers.backend_error(resp.status_code, resp.content), why)
        try:
            data = resp.json()
        except ValueError:
            raise self._failed(502, role, backend, "answered something that is not JSON") from None
        return data

    @staticmethod
    def _failed(status: int, role: str, backend: Backend, why: str) -> BackendFailed:
        message = f"{role} {backend.name}: {why}"
        return BackendFailed(status, answers.error_body(message, status), message)

    # ---- a disaggregated request -----------------------------------------------------------------
    async def serve(self, kind: str, data: dict[str, Any], headers) -> Response:
        try:
            max_tokens = reqs.check(kind, data)
        except reqs.BadRequest as e:
            self.metrics.requests.labels("bad_request").inc()
            return JSONResponse(answers.error_body(str(e), 400, "BadRequestError"), 400)
        stream = bool(data.get("stream"))
        flow = Flow(self, kind, stream, self.router.pick(), headers)
        flow.record.max_tokens = max_tokens
        streaming = False
        try:
            tokens = await self._tokenize(flow, kind, data)
            flow.record.prompt_tokens = len(tokens)
            decoder = flow.decoder if max_tokens > 1 else None
            if decoder is not None:
                self.board.expect(flow.req_id, decoder.ranks)
            span, t = flow.phase("prefill"), time.monotonic()
            body = reqs.prefill_body(kind, data, tokens, flow.req_id, decoder)
            try:
                prefill = await self.post(
                    flow.prefiller, "/v1/completions", body, flow.headers(span), "prefiller"
                )
            except BackendFailed as e:
                flow.finish("prefill_failed", str(e))
                return JSONResponse(e.body, e.status)
            flow.observe("prefill", time.monotonic() - t, span)
            if decoder is None or reqs.finished_at_prefill(prefill):
                flow.finish("prefill_only")
                if stream:
                    return StreamingResponse(_prefill_stream(kind, prefill), media_type=SSE)
                return JSONResponse(answers.prefill_answer(kind, prefill))
            first = reqs.first_token(prefill)
            if first is None:
                why = (
                    f"prefiller {flow.prefiller.name} answered without kv_transfer_params.first_tok: is it "
                    "started with PD on (kv_role kv_producer, enable_pd, pd_role sender)?"
                )
                flow.finish("prefill_failed", why)
                return JSONResponse(answers.error_body(why, 502), 502)
            decode = reqs.decode_body(kind, data, tokens, first, max_tokens, stream)
            if stream:
                streaming = True
                body = self._stream(flow, kind, prefill, decode)
                return FinishedStream(body, lambda: _left(flow), media_type=SSE)
            return await self._answer(flow, kind, prefill, decode)
        except BackendFailed as e:
            flow.finish("tokenize_failed", str(e))
            return JSONResponse(e.body, e.status)
        finally:
            if not streaming:
                flow.finish("client_gone")  # no-op when finished: only a cancelled request gets here so

    async def _tokenize(self, flow: Flow, kind: str, data: dict[str, Any]) -> list[int]:
        if kind == "completions" and reqs.is_token_ids(data["prompt"]):
            return list(data["prompt"])
        span = flow.phase("tokenize")
        out = await self.post(
            flow.prefiller, "/tokenize", reqs.tokenize_body(kind, data), flow.headers(span), "tokenizer"
        )
        if span is not None:
            span.end()
        tokens = out.get("tokens") if isinstance(out, dict) else None
        if not reqs.is_token_ids(tokens):
            raise self._failed(502, "tokenizer", flow.prefiller, "answered no token ids")
        return tokens

    async def _wait_for_transfer(self, flow: Flow) -> None:
        span = flow.phase("transfer_wait")
        result = await self.board.wait(flow.req_id, self.settings.notify_timeout_s)
        flow.record.notifications = f"{result.arrived}/{result.expected}"
        if not result.complete:
            flow.timed_out = True
            self.metrics.wait_timeouts.labels(flow.prefiller.name, flow.decoder.name).inc()
            self._warn_timeout(flow)
        if span is not None:
            span.set_attribute("kvlens.pd.notifications", flow.record.notifications)
            span.set_attribute("kvlens.pd.timed_out", flow.timed_out)
        flow.observe("transfer_wait", result.seconds, span)
        self.board.forget(flow.req_id)

    def _warn_timeout(self, flow: Flow) -> None:
        """Say why a request waited the whole bound, at most once per WARN_EVERY_S: nearly always
        prefillers that notify another address than this proxy listens on."""
        now = time.monotonic()
        if now - self._warned_at < WARN_EVERY_S:
            return
        self._warned_at = now
        s = self.settings
        logger.warning(
            "kvlens pd-proxy: request %s got %s prefiller notices within --notify-timeout %gs; the decoder "
            "was asked anyway and recomputes what did not arrive (more such requests are counted in "
            "kvlens_pd_proxy_wait_timeouts_total, not logged for %gs). Do the prefillers' pd_proxy_host and "
            "pd_proxy_port reach this proxy's --proxy-host %s --proxy-port %d? `kvlens doctor %s %s` checks",
            flow.req_id,
            flow.record.notifications,
            s.notify_timeout_s,
            WARN_EVERY_S,
            s.proxy_host,
            s.proxy_port,
            flow.prefiller.url,
            flow.decoder.url,
        )

    def _decoded_outcome(self, flow: Flow) -> str:
        return "notify_timeout" if flow.timed_out else "ok"

    async def _answer(self, flow: Flow, kind: str, prefill: dict[str, Any], body: dict[str, Any]) -> Response:
        await self._wait_for_transfer(flow)
        span = flow.phase("decode")
        try:
            decoded = await self.post(flow.decoder, "/v1/completions", body, flow.headers(span), "decoder")
        except BackendFailed as e:
            if span is not None:
                span.end()
            flow.finish("decode_failed", str(e))
            return JSONResponse(e.body, e.status)
        if span is not None:
            span.end()
        params = decoded.get("kv_transfer_params")
        kvlens = params.get("kvlens") if isinstance(params, dict) else None
        flow.record.decoder_pd = kvlens.get("pd") if isinstance(kvlens, dict) else None
        flow.finish(self._decoded_outcome(flow))
        return JSONResponse(answers.joined_answer(kind, prefill, decoded))

    async def _stream(
        self, flow: Flow, kind: str, prefill: dict[str, Any], body: dict[str, Any]
    ) -> AsyncIterator[bytes]:
        try:
            heads = answers.head_chunks(kind, prefill)
            for head in heads:
                yield answers.sse(head)
            await self._wait_for_transfer(flow)
            async for chunk in self._decoder_stream(flow, kind, heads[0], body):
                yield chunk
        finally:
            flow.finish("client_gone")  # no-op when the stream ended by itself

    async def _decoder_stream(self, flow: Flow, kind: str, head: dict[str, Any], body: dict[str, Any]):
        assert self.client is not None
        span, t = flow.phase("decode"), time.monotonic()
        splitter, first, done = answers.EventSplitter(), False, False
        try:
            async with self.client.stream(
                "POST", flow.decoder.url + "/v1/completions", json=body, headers=flow.headers(span)
            ) as resp:
                if resp.status_code >= 400:
                    error = answers.backend_error(resp.status_code, await resp.aread())
                    flow.finish(
                        "decode_failed", f"decoder {flow.decoder.name} answered HTTP {resp.status_code}"
                    )
                    yield answers.sse(error)
                    yield answers.DONE
                    return
                async for raw in resp.aiter_bytes():
                    for event in splitter.feed(raw):
                        if event == "[DONE]":
                            done = True
                            continue
                        try:
                            data = json.loads(event)
                        except ValueError:
                            continue
                        if not first and data.get("choices"):
                            first = True
                            flow.observe("decode_first_token", time.monotonic() - t)
                            flow.observe("ttft", time.monotonic() - flow.t0)
                        if "error" in data:
                            flow.finish("decode_failed", str(data["error"])[:500])
                            yield answers.sse(data)
                            continue
                        yield answers.sse(answers.decoder_chunk(kind, data, head))
        except httpx.HTTPError as e:
            why = f"decoder {flow.decoder.name}: {type(e).__name__}: {e}"
            flow.finish("decode_failed", why)
            yield answers.sse(answers.error_body(why, 502))
            yield answers.DONE
            return
        finally:
            if span is not None:
                span.end()
        if not done:
            why = f"decoder {flow.decoder.name}: its stream ended before [DONE]"
            flow.finish("decode_failed", why)
            yield answers.sse(answers.error_body(why, 502))
        yield answers.DONE
        flow.finish(self._decoded_outcome(flow))

    # ---- --no-pd: plain round-robin --------------------------------------------------------------
    async def route(self, kind: str, path: str, data: dict[str, Any], headers) -> Response:
        flow = Flow(self, kind, bool(data.get("stream")), self.router.pick(), headers)
        assert self.client is not None
        request = self.client.build_request(
            "POST", flow.decoder.url + path, json=data, headers=flow.headers()
        )
        try:
            resp = await self.client.send(request, stream=True)
        except httpx.HTTPError as e:
            flow.finish("decode_failed", str(e))
            return JSONResponse(answers.error_body(f"{flow.decoder.name}: {e}", 502), 502)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for raw in resp.aiter_raw():
                    if flow.record.ttft_ms is None:
                        flow.observe("ttft", time.monotonic() - flow.t0)
                    yield raw
                flow.finish("routed" if resp.status_code < 400 else "decode_failed")
            except httpx.HTTPError as e:
                flow.finish("decode_failed", str(e))
            finally:
                await resp.aclose()
                flow.finish("client_gone")

        kept = {k: v for k, v in resp.headers.items() if k.lower() == "content-type"}
        return FinishedStream(relay(), lambda: _left(flow, resp), status_code=resp.status_code, headers=kept)


class FinishedStream(StreamingResponse):
    """A streamed answer whose request is finished however the response ends, even when the
    client left before its body began (the body's own ``finally`` never runs then)."""

    def __init__(self, body: AsyncIterator[bytes], on_close, **kw: Any) -> None:
        super().__init__(body, **kw)
        self._body, self._on_close = body, on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._body.aclose()
            await self._on_close()


async def _left(flow: Flow, resp: httpx.Response | None = None) -> None:
    """The end of a streamed answer: nothing more is read, the request is finished (a no-op when
    it finished already)."""
    if resp is not None:
        await resp.aclose()
    flow.finish("client_gone")


async def _prefill_stream(kind: str, prefill: dict[str, Any]) -> AsyncIterator[bytes]:
    """A streamed answer that the prefiller's one token completed."""
    finish = ((prefill.get("choices") or [{}])[0]).get("finish_reason")
    heads = answers.head_chunks(kind, prefill)
    heads[-1]["choices"][0]["finish_reason"] = finish
    for head in heads:
        yield answers.sse(head)
    yield answers.DONE


async def _read_json(request: Request, limit: int) -> dict[str, Any] | Response:
    declared = request.headers.get("content-length")
    too_big = JSONResponse(
        answers.error_body(f"request body over {limit} bytes", 413, "RequestTooLarge"), 413
    )
    if declared and declared.isdigit() and int(declared) > limit:
        return too_big
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            return too_big
    try:
        data = json.loads(body)
    except ValueError as e:
        return JSONResponse(answers.error_body(f"the body is not JSON: {e}", 400, "BadRequestError"), 400)
    if not isinstance(data, dict):
        return JSONResponse(answers.error_body("the body must be a JSON object", 400, "BadRequestError"), 400)
    return data


def build_app(proxy: PDProxy) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await proxy.start()
        yield
        await proxy.close()

    app = FastAPI(title="kvlens pd-proxy", lifespan=lifespan)
    app.state.proxy = proxy

    async def handle(kind: str, path: str, request: Request) -> Response:
        data = await _read_json(request, proxy.settings.max_request_bytes)
        if isinstance(data, Response):
            proxy.metrics.requests.labels("bad_request").inc()
            return data
        headers = {k.lower(): v for k, v in request.headers.items()}
        if proxy.settings.no_pd:
            return await proxy.route(kind, path, data, headers)
        return await proxy.serve(kind, data, headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle("completions", "/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await handle("chat", "/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models() -> Response:
        assert proxy.client is not None
        decoder = proxy.router.decoders[0]
        try:
            resp = await proxy.client.get(decoder.url + "/v1/models")
        except httpx.HTTPError as e:
            return JSONResponse(answers.error_body(f"decoder {decoder.name}: {e}", 502), 502)
        return Response(resp.content, resp.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        listener = proxy.listener
        if listener is not None and not listener.alive:
            why = f"the notification listener stopped: {listener.error}"
            return JSONResponse({"status": "unhealthy", "error": why}, 503)
        return JSONResponse({"status": "ok", "waiting_for_notifications": proxy.board.waiting})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(proxy.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/kvlens/pd/requests")
    async def records(limit: int = 100) -> Response:
        return JSONResponse({"requests": proxy.records.newest(limit)})

    return app


def run(settings: ProxySettings) -> int:
    """Serve until interrupted (``kvlens pd-proxy``)."""
    import uvicorn

    from .observe import provider_from_env, tracing_configured

    provider = provider_from_env() if tracing_configured() else None
    proxy = PDProxy(settings, provider)
    mode = "round-robin (--no-pd)" if settings.no_pd else "prefill/decode"
    logger.warning(
        "kvlens pd-proxy on http://%s:%d, %s; prefiller notices on %s:%d; prefillers %s; decoders %s",
        settings.host,
        settings.port,
        mode,
        settings.proxy_host,
        settings.proxy_port,
        [b.name for b in proxy.router.prefillers],
        [b.name for b in proxy.router.decoders],
    )
    uvicorn.run(build_app(proxy), host=settings.host, port=settings.port, log_level="warning")
    return 0
