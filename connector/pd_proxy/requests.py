"""What the proxy sends the prefiller and the decoder for one client request (LMCache's example
proxy's protocol), and the checks a request passes first. Pure functions of the client's JSON."""

from __future__ import annotations

from typing import Any

from .backends import Backend

DEFAULT_MAX_TOKENS = 16  # vLLM's and OpenAI's for completions
# Settings of a chat request that mean the same in a completion request (the rest is chat-only:
# messages, tools, templates, chat logprobs, ...).
CHAT_SAMPLING = frozenset(
    "model temperature top_p top_k min_p seed stop stop_token_ids frequency_penalty presence_penalty "
    "repetition_penalty ignore_eos min_tokens user skip_special_tokens spaces_between_special_tokens "
    "include_stop_str_in_output logit_bias priority cache_salt truncate_prompt_tokens".split()
)
CHAT_TOKENIZE = (
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "tools",
)
REPLACED = frozenset(
    ("prompt", "max_tokens", "max_completion_tokens", "stream", "stream_options", "kv_transfer_params")
)


class BadRequest(ValueError):
    """A request the proxy cannot serve, said in one line (an HTTP 400)."""


def is_token_ids(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(type(t) is int for t in prompt)


def check(kind: str, data: dict[str, Any]) -> int:
    """The client's max_tokens, after the checks; raises BadRequest."""
    if kind == "completions":
        prompt = data.get("prompt")
        if not (isinstance(prompt, str) and prompt) and not is_token_ids(prompt):
            raise BadRequest("'prompt' must be one non-empty string or one list of token ids")
        limit = data.get("max_tokens", DEFAULT_MAX_TOKENS)
    else:
        if not isinstance(data.get("messages"), list) or not data["messages"]:
            raise BadRequest("'messages' must be a non-empty list")
        limit = data.get("max_completion_tokens", data.get("max_tokens"))
    if limit is None:
        limit = DEFAULT_MAX_TOKENS
    if type(limit) is not int or limit < 1:
        raise BadRequest("'max_tokens' must be a whole number, 1 or more")
    for key, why in (("n", "more than one choice"), ("best_of", "best_of")):
        if data.get(key) not in (None, 1):
            raise BadRequest(f"'{key}': {why} is not supported through the PD proxy")
    if kind == "completions" and data.get("echo"):
        raise BadRequest("'echo' is not supported through the PD proxy")
    return limit


def tokenize_body(kind: str, data: dict[str, Any]) -> dict[str, Any]:
    if kind == "completions":
        return {"prompt": data["prompt"]}
    body = {"messages": data["messages"]}
    body.update({k: data[k] for k in CHAT_TOKENIZE if k in data})
    if "model" in data:
        body["model"] = data["model"]
    return body


def _sampling(kind: str, data: dict[str, Any]) -> dict[str, Any]:
    if kind == "completions":
        return {k: v for k, v in data.items() if k not in REPLACED}
    return {k: v for k, v in data.items() if k in CHAT_SAMPLING}


def disagg_spec(req_id: str, decoder: Backend) -> dict[str, Any]:
    return {
        "req_id": req_id,
        "receiver_host": decoder.host,
        "receiver_init_port": list(decoder.init_ports),
        "receiver_alloc_port": list(decoder.alloc_ports),
    }


def prefill_body(
    kind: str, data: dict[str, Any], tokens: list[int], req_id: str, decoder: Backend | None
) -> dict[str, Any]:
    """The prefiller's request: the prompt's token ids, one token, no streaming, and (with a
    decoder) where to send the KV. Without a decoder the prefiller's answer is the whole answer."""
    body = _sampling(kind, data)
    body.update(prompt=tokens, max_tokens=1, stream=False)
    if isinstance(body.get("min_tokens"), int):
        body["min_tokens"] = min(body["min_tokens"], 1)
    if decoder is not None:
        body["kv_transfer_params"] = {"ret_first_tok": True, "disagg_spec": disagg_spec(req_id, decoder)}
    return body


def decode_body(
    kind: str, data: dict[str, Any], tokens: list[int], first_tok: int, max_tokens: int, stream: bool
) -> dict[str, Any]:
    """The decoder's request: the prompt and the first token, the rest of the tokens, no
    kv_transfer_params (the decoder finds the KV by its keys)."""
    body = _sampling(kind, data)
    body.update(prompt=[*tokens, first_tok], max_tokens=max_tokens - 1, stream=stream)
    if isinstance(body.get("min_tokens"), int):
        body["min_tokens"] = max(body["min_tokens"] - 1, 0)
    if stream and data.get("stream_options") is not None:
        body["stream_options"] = data["stream_options"]
    return body


def first_token(prefill: dict[str, Any]) -> int | None:
    params = prefill.get("kv_transfer_params")
    tok = params.get("first_tok") if isinstance(params, dict) else None
    return tok if type(tok) is int else None


def finished_at_prefill(prefill: dict[str, Any]) -> bool:
    """The prefiller's one token ended the answer (end of sequence, or a stop string)."""
    choices = prefill.get("choices") or [{}]
    return choices[0].get("finish_reason") == "stop"
