"""The client's answer, put together from the prefiller's first token and the decoder's rest.

The decoder is sent ``prompt + [first token]`` and ``max_tokens - 1`` through ``/v1/completions``;
these functions turn what it answers into what the client asked for: completion or chat chunks
(the same head chunk LMCache's example proxy sends first), one id for the whole answer, usage
counted as one request (the first token is the client's, not part of the prompt), or one JSON
answer for a client that did not stream.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any


def sse(data: dict[str, Any]) -> bytes:
    return ("data: " + json.dumps(data, separators=(",", ":")) + "\n\n").encode()


DONE = b"data: [DONE]\n\n"


class EventSplitter:
    """Server-sent events from a byte stream cut anywhere: ``feed`` yields each whole event's
    data (``"[DONE]"`` included) as a string."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> Iterator[str]:
        self._buf += chunk
        while True:
            cut = self._buf.find(b"\n\n")
            if cut < 0:
                return
            event, self._buf = self._buf[:cut], self._buf[cut + 2 :]
            lines = [
                ln[5:].lstrip()
                for ln in event.decode(errors="replace").splitlines()
                if ln.startswith("data:")
            ]
            if lines:
                yield "\n".join(lines)


def head_chunks(kind: str, prefill: dict[str, Any]) -> list[dict[str, Any]]:
    """The first chunk(s) of a streamed answer: the prefiller's token (chat: the role first)."""
    choice = (prefill.get("choices") or [{}])[0]
    common = {"id": prefill.get("id"), "created": prefill.get("created"), "model": prefill.get("model")}
    if kind == "completions":
        c = {
            "index": 0,
            "text": choice.get("text", ""),
            "logprobs": None,
            "finish_reason": None,
            "stop_reason": None,
        }
        return [{**common, "object": "text_completion", "choices": [c], "usage": None}]
    role = {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    text = {"index": 0, "delta": {"content": choice.get("text", "")}, "logprobs": None, "finish_reason": None}
    return [
        {**common, "object": "chat.completion.chunk", "choices": [role]},
        {**common, "object": "chat.completion.chunk", "choices": [text]},
    ]


def client_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """The decoder's usage as the client's request sees it: the prompt it sent, and the first token
    (computed by the prefiller) counted as generated."""
    if not usage:
        return usage
    out = dict(usage)
    if isinstance(out.get("prompt_tokens"), int) and out["prompt_tokens"] > 0:
        out["prompt_tokens"] -= 1
    if isinstance(out.get("completion_tokens"), int):
        out["completion_tokens"] += 1
    return out


def decoder_chunk(kind: str, data: dict[str, Any], head: dict[str, Any]) -> dict[str, Any]:
    """One chunk of the decoder's completion stream as a chunk of the client's answer."""
    out = {**data, "id": head.get("id"), "created": head.get("created"), "model": head.get("model")}
    if "usage" in data and data["usage"] is not None:
        out["usage"] = client_usage(data["usage"])
    if kind == "completions":
        return out
    choices = []
    for c in data.get("choices") or []:
        delta = {"content": c.get("text", "")}
        choices.append(
            {
                "index": c.get("index", 0),
                "delta": delta,
                "logprobs": c.get("logprobs"),
                "finish_reason": c.get("finish_reason"),
            }
        )
    out["object"] = "chat.completion.chunk"
    out["choices"] = choices
    return out


def prefill_answer(kind: str, prefill: dict[str, Any]) -> dict[str, Any]:
    """The prefiller's answer as the client's whole answer (its first token ended the request)."""
    answer = {k: v for k, v in prefill.items() if k != "kv_transfer_params"}
    if kind == "completions":
        return answer
    choices = []
    for c in prefill.get("choices") or []:
        message = {"role": "assistant", "content": c.get("text", "")}
        choices.append(
            {
                "index": c.get("index", 0),
                "message": message,
                "logprobs": None,
                "finish_reason": c.get("finish_reason"),
            }
        )
    return {**answer, "object": "chat.completion", "choices": choices}


def joined_answer(kind: str, prefill: dict[str, Any], decoded: dict[str, Any]) -> dict[str, Any]:
    """One JSON answer: the prefiller's token, then the decoder's text, under the prefiller's id."""
    first = ((prefill.get("choices") or [{}])[0]).get("text", "")
    choice = dict((decoded.get("choices") or [{}])[0])
    text = first + (choice.get("text") or "")
    answer = {
        **decoded,
        "id": prefill.get("id"),
        "created": prefill.get("created"),
        "model": prefill.get("model"),
        "usage": client_usage(decoded.get("usage")),
    }
    if kind == "completions":
        answer["choices"] = [{**choice, "index": 0, "text": text}]
        return answer
    message = {"role": "assistant", "content": text}
    answer["object"] = "chat.completion"
    answer["choices"] = [
        {"index": 0, "message": message, "logprobs": None, "finish_reason": choice.get("finish_reason")}
    ]
    return answer


def error_body(message: str, code: int, kind: str = "BadGatewayError") -> dict[str, Any]:
    """An error as vLLM's OpenAI server writes one."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def backend_error(status: int, body: bytes) -> dict[str, Any]:
    """A backend's error answer, passed on as it is when it is JSON."""
    try:
        data = json.loads(body)
        if isinstance(data, dict):
            return data
    except ValueError:
        pass
    return error_body(body.decode(errors="replace")[:2000] or f"HTTP {status}", status)
