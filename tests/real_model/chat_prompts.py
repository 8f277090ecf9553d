"""The chat prompts the real-model tests send: a support assistant's policy as the system
prompt (three 256-token chunks and a tail once templated), questions about it, a second turn
of a conversation, a prompt shorter than one chunk and one of six chunks. They are rendered with
the model's own chat template and sent as token ids, as a chat client's would be."""

from __future__ import annotations

from functools import cache

from scripts.workload import PARAGRAPHS, QUESTIONS

SYSTEM = "\n\n".join(PARAGRAPHS)
MAX_TOKENS = 32  # greedy, ending at the model's end of turn


def conversations() -> list[list[dict[str, str]]]:
    def chat(system: str | None, *turns: str) -> list[dict[str, str]]:
        roles = ("user", "assistant")
        head = [{"role": "system", "content": system}] if system is not None else []
        return head + [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]

    return [
        *(chat(SYSTEM, q) for q in QUESTIONS[:4]),
        chat(SYSTEM, QUESTIONS[0], "Express delivery takes one to two working days.", QUESTIONS[6]),
        chat(None, "What is the capital of France?"),  # shorter than one chunk: nothing to reuse
        chat(SYSTEM + "\n\n" + SYSTEM, QUESTIONS[5]),  # six chunks and a tail
    ]


@cache
def tokenizer(model: str):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


@cache
def prompts(model: str) -> tuple[tuple[int, ...], ...]:
    out = []
    for messages in conversations():
        ids = tokenizer(model).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        out.append(tuple(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return tuple(out)


def decode(model: str, token_ids: list[int]) -> str:
    return tokenizer(model).decode(token_ids)
