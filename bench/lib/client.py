"""Requests to a vLLM server, and what each took.

Prompts are token ids, so every mode sees exactly the same tokens (no tokenizer round trip).
``complete`` is a blocking, non-streaming request: with ``max_tokens=1`` its wall time is the
time to first token as REFERENCE.md section 9 defines it. ``stream`` is an asyncio streaming
request for workloads with many users in flight; its TTFT is the arrival of the first token.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import aiohttp

from .servers import SERVED_MODEL_NAME

REQUEST_TIMEOUT_S = 600.0
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy


@dataclass(frozen=True, slots=True)
class Completion:
    seconds: float  # wall time of the request
    prompt_tokens: int
    cached_tokens: int  # usage.prompt_tokens_details.cached_tokens: vLLM's hit plus the connector's
    token_ids: tuple[int, ...]  # generated tokens
    kv_transfer_params: dict[str, Any] | None  # KVLens: num_lmcache_cached_tokens, kvlens {...}


@dataclass(frozen=True, slots=True)
class Streamed:
    ttft: float  # seconds from sending to the first generated token
    latency: float  # seconds from sending to the end of the stream
    prompt_tokens: int
    cached_tokens: int
    token_ids: tuple[int, ...]


def _body(
    prompt: list[int], max_tokens: int, kv_params: dict[str, Any] | None, ignore_eos: bool = True
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": SERVED_MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        "return_token_ids": True,
    }
    if kv_params:
        body["kv_transfer_params"] = kv_params
    return body


def _cached(usage: dict[str, Any] | None) -> int:
    details = (usage or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


class Client:
    def __init__(self, url: str) -> None:
        self.url = url

    def _post(self, path: str, body: dict[str, Any] | None, timeout: float) -> bytes:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body or {}).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with _OPENER.open(req, timeout=timeout) as resp:
            return resp.read()

    def complete(
        self,
        prompt: list[int],
        max_tokens: int = 1,
        kv_params: dict[str, Any] | None = None,
        timeout: float = REQUEST_TIMEOUT_S,
    ) -> Completion:
        body = _body(prompt, max_tokens, kv_params)
        t0 = time.perf_counter()
        raw = self._post("/v1/completions", body, timeout)
        seconds = time.perf_counter() - t0
        out = json.loads(raw)
        usage = out.get("usage") or {}
        return Completion(
            seconds=seconds,
            prompt_tokens=int(usage.get("prompt_tokens") or len(prompt)),
            cached_tokens=_cached(usage),
            token_ids=tuple(out["choices"][0].get("token_ids") or ()),
            kv_transfer_params=out.get("kv_transfer_params"),
        )

    def reset_prefix_cache(self) -> None:
        """Flush vLLM's own prefix cache (not the connector's): the next identical prompt must
        come from the connector or be recomputed."""
        self._post("/reset_prefix_cache", None, 60.0)

    def metrics_text(self) -> str:
        with _OPENER.open(self.url + "/metrics", timeout=30) as resp:
            return resp.read().decode()

    def metric_sum(self, name: str, **labels: str) -> float:
        """The sum of a metric's samples whose labels include ``labels`` (0 when absent)."""
        return metric_sum(self.metrics_text(), name, **labels)


def metric_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a /metrics page: (name, labels, value)."""
    out = []
    for line in text.splitlines():
        m = None if line.startswith("#") else re.match(r"^([^\s{]+)(\{[^}]*\})?\s+(\S+)", line)
        if m:
            out.append(
                (m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")), float(m.group(3)))
            )
    return out


def metric_sum(text: str, name: str, **labels: str) -> float:
    """``Client.metric_sum`` over a /metrics page already fetched (several metrics, one fetch)."""
    samples = metric_samples(text)
    return sum((v for n, have, v in samples if n == name and labels.items() <= have.items()), 0.0)


async def stream(
    session: aiohttp.ClientSession,
    url: str,
    prompt: list[int],
    max_tokens: int,
    timeout: float = REQUEST_TIMEOUT_S,
    kv_params: dict[str, Any] | None = None,
    ignore_eos: bool = True,
) -> Streamed:
    """One streaming completion; TTFT is when the first chunk with a generated token arrives.
    ``ignore_eos`` False: the answer ends where the model ends it (a real model's answers)."""
    body = _body(prompt, max_tokens, kv_params, ignore_eos)
    body.update({"stream": True, "stream_options": {"include_usage": True}})
    tokens: list[int] = []
    usage: dict[str, Any] = {}
    ttft = None
    t0 = time.perf_counter()
    async with session.post(
        url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout)
    ) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            for choice in chunk.get("choices") or ():
                ids = choice.get("token_ids") or ()
                if ids and ttft is None:
                    ttft = time.perf_counter() - t0
                tokens.extend(ids)
            usage = chunk.get("usage") or usage
    latency = time.perf_counter() - t0
    return Streamed(
        ttft=ttft if ttft is not None else latency,
        latency=latency,
        prompt_tokens=int(usage.get("prompt_tokens") or len(prompt)),
        cached_tokens=_cached(usage),
        token_ids=tuple(tokens),
    )
