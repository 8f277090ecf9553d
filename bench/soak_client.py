"""The soak's workload and its HTTP client: a few long shared documents, short unique questions,
completions and chat, streaming and not, and clients that hang up mid-stream.

Documents for completions are token ids (no tokenizer in the loop); chat documents are text of
seeded words, sent as the system message so that every question on a document shares its prefix.
"""

from __future__ import annotations

import http.client
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

from bench.lib.servers import SERVED_MODEL_NAME

TIMEOUT_S = 180.0
_WORDS = (
    "cache block chunk prefix token layer model engine server request tier disk memory "
    "store load evict index scheduler worker stream answer question document shared long"
).split()


def token_ids(n: int, seed: int) -> list[int]:
    """Deterministic ids inside the tiny model's vocabulary (as tests/telemetry/serve.py)."""
    x, out = seed * 7919 + 17, []
    for _ in range(n):
        x = (x * 1103515245 + 12345) % (2**31)
        out.append(20 + x % 1200)
    return out


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) + str(rng.randrange(100)) for _ in range(n))


@dataclass(frozen=True)
class Request:
    """One request: ``prompt`` is token ids (completions) or ``(system, user)`` text (chat)."""

    chat: bool
    prompt: Any
    max_tokens: int
    stream: bool = False
    hang_up_after: int = 0  # streaming: close the connection after this many events (0: never)
    prompt_logprobs: int | None = None  # set: vLLM reads no cache for it (a one-pass cold prefill)

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"model": SERVED_MODEL_NAME, "max_tokens": self.max_tokens, "temperature": 0.0}
        body["ignore_eos"] = True
        if self.chat:
            system, user = self.prompt
            body["messages"] = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        else:
            body["prompt"] = self.prompt
        if self.stream:
            body["stream"] = True
        if self.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs
        return body

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


@dataclass
class Outcome:
    ok: bool
    seconds: float
    text: str = ""
    hung_up: bool = False
    error: str = ""
    kv: dict[str, Any] = field(default_factory=dict)  # the response's kv_transfer_params


def send(port: int, req: Request) -> Outcome:
    """Send one request; never raises (a failure is an Outcome with ok False)."""
    start = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        conn.request("POST", req.path, json.dumps(req.body()), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return Outcome(
                False, time.monotonic() - start, error=f"HTTP {resp.status}: {resp.read()[:300]!r}"
            )
        if req.stream:
            return _read_stream(resp, req, start)
        data = json.loads(resp.read())
        choice = data["choices"][0]
        text = choice["message"]["content"] if req.chat else choice["text"]
        if choice.get("finish_reason") == "error":
            return Outcome(False, time.monotonic() - start, text, error="finish_reason error")
        return Outcome(True, time.monotonic() - start, text, kv=data.get("kv_transfer_params") or {})
    except Exception as e:  # connection refused, reset, timeout, bad JSON
        return Outcome(False, time.monotonic() - start, error=repr(e)[:300])
    finally:
        conn.close()


def _read_stream(resp: http.client.HTTPResponse, req: Request, start: float) -> Outcome:
    parts, events = [], 0
    while True:
        line = resp.readline()
        if not line:
            return Outcome(False, time.monotonic() - start, "".join(parts), error="stream ended early")
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return Outcome(True, time.monotonic() - start, "".join(parts))
        events += 1
        if req.hang_up_after and events >= req.hang_up_after:
            return Outcome(True, time.monotonic() - start, "".join(parts), hung_up=True)
        data = json.loads(payload)
        if "error" in data:
            return Outcome(False, time.monotonic() - start, error=str(data["error"])[:300])
        for choice in data.get("choices", []):
            if choice.get("finish_reason") == "error":
                return Outcome(False, time.monotonic() - start, error="finish_reason error")
            parts.append(
                (choice.get("delta") or {}).get("content") or "" if req.chat else choice.get("text", "")
            )


class Workload:
    """Documents, probes and the random mix each client thread draws from."""

    def __init__(self, doc_tokens: tuple[int, ...], chat_doc_words: tuple[int, ...], max_tokens: int) -> None:
        self.docs = [token_ids(n, 1000 + i) for i, n in enumerate(doc_tokens)]
        self.chat_docs = [words(n, 2000 + i) for i, n in enumerate(chat_doc_words)]
        self.max_tokens = max_tokens

    def probes(self) -> list[Request]:
        """One fixed question per document, answered cold before the soak: the references."""
        probes = [
            Request(False, doc + token_ids(24, 90 + i), self.max_tokens) for i, doc in enumerate(self.docs)
        ]
        probes += [
            Request(True, (doc, f"probe question {i}: what is in it?"), self.max_tokens)
            for i, doc in enumerate(self.chat_docs)
        ]
        return probes

    def draw(self, rng: random.Random, unique: int) -> Request:
        """A short unique question on a random shared document; 10% hang up mid-stream."""
        stream = rng.random() < 0.5
        hang_up = 2 if stream and rng.random() < 0.2 else 0  # half stream, a fifth of those hang up
        if self.chat_docs and rng.random() < 0.3:
            doc = rng.choice(self.chat_docs)
            return Request(
                True, (doc, f"question {unique}: {words(8, unique)}?"), self.max_tokens, stream, hang_up
            )
        question = token_ids(rng.randrange(8, 48), 10_000 + unique)
        return Request(False, rng.choice(self.docs) + question, self.max_tokens, stream, hang_up)
