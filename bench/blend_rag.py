"""Blending's quality and time to first token on the RAG set, against full prefill (issue 39 item 4).

    python bench/blend_rag.py [--quick] [--cases 4-docs,8-docs] [--modes full,none,kvlens-cpu-blend,...]

LMCache's blend flow on the real model (SmolLM2-135M-Instruct): every document of the RAG set
(``bench/lib/rag_set.py``: invented facts, questions with known answers) is sent once with the
separator after it (its KV computed and, when blending, stored), then each question is asked over
its document and others, in an order that changes from question to question: the chat template's
head with the system prompt, the documents, the question and the template's tail, joined by the
separator's token ids (``" # # "``, tokenised once without special tokens). Every mode gets the
same token ids. A case names how many documents a prompt holds (``4-docs``: the question's
document and the next three, rotated so that it sits first, second, third or fourth; ``8-docs``:
all eight, shuffled per question).

Modes, each a vLLM server:

* ``full``: prefix caching off: every prompt computed in full. The reference.
* ``none``: vLLM's prefix cache alone (prefix caching): only a prompt's start is reused.
* ``kvlens-cpu-blend``: KVLens blending at LMCache's default (check layer 1, 15% recomputed);
  ``kvlens-cpu-blend0``: recomputing nothing but what was not stored (naive concatenation).
  Before every question vLLM's prefix cache is flushed, so the documents' KV comes from KVLens.
  The RAG set's documents are ~150 tokens, below LMCache's ``blend_min_tokens`` (256): these modes
  set it to 64 (``bench/lib/modes.py``).

Per case and repetition: accuracy (``rag_set.is_correct``), greedy agreement with full prefill
(``tokens x full``: the share of the first --answer-len tokens equal up to the first difference;
``exact x full``), TTFT (median, and its ratio to full), prompt tokens reused (vLLM's count) and,
when blending, the tokens the blend reused and recomputed (the change of the server's
blend_tokens counters over the question: a streamed response carries no kv_transfer_params).
Writes .run/bench/results/blend_rag.json.
"""

from __future__ import annotations

import asyncio
import functools
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib import rag_set as rag  # noqa: E402
from bench.lib.client import metric_sum  # noqa: E402
from bench.lib.runner import Case, Figure, Option, main  # noqa: E402
from bench.lib.served import LiveMode, ServerShape  # noqa: E402
from bench.lib.ttft import SKIP_SAVE  # noqa: E402
from bench.rag_quality import QUALITY, RagQuality, _share, _tokenizer, answer_record  # noqa: E402

SEPARATOR = " # # "  # LMCache's blend_special_str, KVLens's default
PLACEHOLDER = "\x00DOCUMENTS\x00"
FIGURES = (
    Figure("accuracy", "accuracy", panel=QUALITY),
    Figure("tokens_vs_full", "tokens x full", panel=QUALITY),
    Figure("exact_vs_full", "exact x full", panel=QUALITY),
    Figure("ttft_ms", "TTFT ms (median)", "{:.0f}", ratio=True, log=True),
    Figure("cached_tokens", "reused prompt tokens", "{:.0f}", plot=False),
    Figure("recomputed_tokens", "blend: recomputed", "{:.0f}", plot=False),
    Figure("prompt_tokens", "prompt tokens", "{:.0f}", plot=False),
)
CASES = {"4-docs": 4, "8-docs": 8}


@functools.cache
def separator_ids(model: Path) -> tuple[int, ...]:
    return tuple(_tokenizer(model).encode(SEPARATOR, add_special_tokens=False))


@functools.cache
def document_ids(model: Path, key: str) -> tuple[int, ...]:
    return tuple(_tokenizer(model).encode(rag.document(key).render(), add_special_tokens=False))


def frame(model: Path, question: rag.Question) -> tuple[list[int], list[int]]:
    """The chat template's head (through the system prompt and the user turn's start) and the
    question with the template's tail, as token ids."""
    tok = _tokenizer(model)
    messages = [
        {"role": "system", "content": rag.SYSTEM_PROMPT},
        {"role": "user", "content": PLACEHOLDER},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    head, tail = text.split(PLACEHOLDER)
    encode = functools.partial(tok.encode, add_special_tokens=False)
    return list(encode(head)), list(encode(rag.QUESTION_PREFIX + question.text + tail))


def blend_prompt(model: Path, question: rag.Question, order: list[str]) -> list[int]:
    """Head, documents, question: joined by the separator's ids (LMCache's example flow)."""
    head, question_ids = frame(model, question)
    sep = list(separator_ids(model))
    ids = head
    for key in order:
        ids = ids + sep + list(document_ids(model, key))
    return ids + sep + question_ids


def orders(count: int, questions: list[rag.Question], seed: int = 39) -> list[list[str]]:
    """Per question, ``count`` documents holding its own, in an order that changes."""
    keys = list(rag.canonical_order())
    rng = random.Random(seed)
    out = []
    for i, q in enumerate(questions):
        at = keys.index(q.document)
        chosen = [keys[(at + j) % len(keys)] for j in range(count)]
        if count == len(keys):
            rng.shuffle(chosen)
        else:
            shift = i % count  # the question's document first, second, third...
            chosen = chosen[-shift:] + chosen[:-shift] if shift else chosen
        out.append(chosen)
    return out


def blend_tokens(lm: LiveMode) -> dict[str, float]:
    """The server's blended prompt tokens so far, by kind (a streamed response carries no
    kv_transfer_params in vLLM 0.32, so a question's blend is read as the difference)."""
    text = lm.client.metrics_text()
    kinds = ("reused", "recomputed", "recomputed_by_deviation", "not_stored")
    return {kind: metric_sum(text, "vllm:kvlens_blend_tokens_total", kind=kind) for kind in kinds}


def blend_delta(lm: LiveMode, before: dict[str, float], wait_s: float = 2.0) -> dict[str, float]:
    """A question's blended tokens: the counters' change once the engine's stats for its last step
    reached /metrics (within ``wait_s``; none when it did not blend)."""
    deadline = time.monotonic() + wait_s
    while (after := blend_tokens(lm)) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    return {kind: n - before[kind] for kind, n in after.items()}


class BlendRag(RagQuality):
    name = "blend_rag"
    title = "Blending on the RAG set: accuracy, agreement with full prefill and TTFT, per mode"
    figures = FIGURES
    checks = ()
    legend = (
        "accuracy: share of questions answered right; tokens x full: mean share of the first answer tokens "
        "equal to full prefill's up to the first difference; exact x full: share of identical answers.",
        "reused prompt tokens: vLLM's count per question (a blend reports all but the last token); blend: "
        "recomputed: tokens the blend computed (not stored, and by deviation).",
    )
    default_modes = "full,none,kvlens-cpu-blend,kvlens-cpu-blend0"
    quick_modes = "full,kvlens-cpu-blend"
    kvlens_tiers = "cpu-blend"
    case_label = "documents per prompt"
    repeats = (2, 1)
    options = {
        "cases": Option("4-docs,8-docs", "4-docs", f"documents per prompt, of {', '.join(CASES)}"),
        "per_document": Option(3, 1, "questions per document (the first N of each)"),
        "answer_len": Option(32, help="generated tokens at most per answer"),
    }

    def cases(self) -> list[Case]:
        names = [n.strip() for n in self.args.cases.split(",") if n.strip()]
        if not names or any(n not in CASES for n in names):
            raise SystemExit(f"--cases: known: {', '.join(CASES)}")
        questions = self.questions()
        self.prompts = {
            n: [
                (q, blend_prompt(self.model, q, order))
                for q, order in zip(questions, orders(CASES[n], questions), strict=True)
            ]
            for n in names
        }
        return [Case(n) for n in names]

    def server_shape(self) -> ServerShape:
        longest = max(len(ids) for prompts in self.prompts.values() for _, ids in prompts)
        return ServerShape(longest + self.args.answer_len + 16, kv_space_gib=1, working_set_gb=0.2)

    def warm_up(self, lm: LiveMode) -> None:
        """Each document once, the separator after it: stored per segment when blending."""
        sep = list(separator_ids(self.model))
        for key in rag.canonical_order():
            lm.client.complete(list(document_ids(self.model, key)) + sep)
        lm.client.reset_prefix_cache()

    def measure(self, lm: LiveMode, case: Case, rep: int) -> dict[str, Any]:
        connector = lm.mode.connector is not None
        if lm.mode.prefix_caching and not connector:
            lm.client.reset_prefix_cache()  # vLLM's own cache: built by this case's questions
        answers = []
        for q, ids in self.prompts[case.name]:
            if connector:
                lm.client.reset_prefix_cache()  # the documents come from KVLens
            before = blend_tokens(lm) if connector else {}
            done = asyncio.run(self._ask(lm, ids, SKIP_SAVE if connector else None))
            blend = blend_delta(lm, before) if connector else {}
            answers.append({**answer_record(self.model, q, done), "blend": blend})
        return {
            "accuracy": _share(a["correct"] for a in answers),
            "ttft_ms": [a["ttft_ms"] for a in answers],
            "cached_tokens": [a["cached_tokens"] for a in answers],
            "recomputed_tokens": [a["blend"].get("recomputed", 0) for a in answers],
            "prompt_tokens": [a["prompt_tokens"] for a in answers],
            "answers": answers,
        }

    def workload(self) -> dict[str, Any]:
        return {
            "questions": [q.key for q in self.questions()],
            "separator": SEPARATOR,
            "documents_per_prompt": {n: CASES[n] for n in self.prompts},
            "prompt_tokens": {n: statistics.fmean(len(ids) for _, ids in p) for n, p in self.prompts.items()},
            "answer_len": self.args.answer_len,
        }


if __name__ == "__main__":
    sys.exit(main(BlendRag))
