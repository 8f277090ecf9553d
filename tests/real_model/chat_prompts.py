"""The chat prompts the real-model tests send: a support assistant's policy as the system
prompt (three 256-token chunks and a tail once templated), questions about it, a second turn
of a conversation, a prompt shorter than one chunk and one of six chunks. They are rendered with
the model's own chat template and sent as token ids, as a chat client's would be."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

from scripts.workload import PARAGRAPHS, QUESTIONS

REPO = Path(__file__).resolve().parents[2]
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


def real_model_dir() -> Path:
    return Path(os.environ.get("KVLENS_REAL_MODEL", REPO / ".run" / "smollm2-135m"))


@cache
def prompts(model: str) -> tuple[tuple[int, ...], ...]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    out = []
    for messages in conversations():
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        out.append(tuple(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return tuple(out)


def decode(model: str, token_ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model).decode(token_ids)
