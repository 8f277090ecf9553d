"""Answer quality on the RAG set with KV that KVLens loaded, against full prefill (issue 38 item 3b).

    python bench/rag_quality.py [--quick] [--modes full,none,kvlens] [--orders canonical,shuffled]

The RAG set (``bench/lib/rag_set.py``): invented documents, questions each answered in one of
them, known answers. Every prompt is the set's system prompt, every document in one order, then
one question, in the model's chat template; the prompts are tokenised here and sent as token ids,
so every mode gets the same tokens. Answers are greedy, up to --answer-len tokens, ending where
the model ends them. The model is the real one (SmolLM2-135M-Instruct, ``--real`` of the other
benchmarks): a random model has no answers to judge.

Modes, each a vLLM server:

* ``full``: no connector, prefix caching off: every prompt computed in full. The reference:
  every later approximation (blending documents' KV at any position) is held to it.
* ``none``: vLLM's own prefix cache: the documents computed once (the warm-up), each question
  computes only its own tokens on them.
* ``kvlens-cpu``: KVLens's CPU tier. The warm-up stores the documents; before every question
  vLLM's prefix cache is flushed (``POST /reset_prefix_cache``), so the documents' KV is what
  KVLens loads. Questions are sent with ``skip_save``: every repetition loads the same chunks.

Per document order (a case) and repetition: accuracy (the share of questions answered right,
``rag_set.is_correct``); agreement with full prefill in the same repetition (``exact x full``:
the share of questions whose generated tokens equal full prefill's; ``tokens x full``: the mean
share of tokens equal up to the first difference, ``rag_set.token_agreement``); the same exact
match against vLLM's own prefix cache; TTFT per question (median) and its ratio to full; prompt
tokens served from a cache. Prints the tables; writes .run/bench/results/rag_quality.json.
"""

from __future__ import annotations

import asyncio
import functools
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib import rag_set as rag  # noqa: E402
from bench.lib.client import stream  # noqa: E402
from bench.lib.report import Records  # noqa: E402
from bench.lib.runner import Case, Check, Figure, Option, main  # noqa: E402
from bench.lib.served import LiveMode, ServedBenchmark, ServerShape  # noqa: E402
from bench.lib.ttft import SKIP_SAVE  # noqa: E402

QUALITY = "answers (share of questions)"
CHUNK = 256  # KVLens's default chunk: a hit may leave up to 255 tokens of the documents to compute
FIGURES = (
    Figure("accuracy", "accuracy", panel=QUALITY),
    Figure("exact_vs_full", "exact x full", panel=QUALITY),
    Figure("tokens_vs_full", "tokens x full", panel=QUALITY),
    Figure("exact_vs_prefix_cache", "exact x vLLM prefix cache", plot=False),
    Figure("ttft_ms", "TTFT ms (median)", "{:.0f}", ratio=True, log=True),
    Figure("cached_tokens", "cached prompt tokens", "{:.0f}", plot=False),
    Figure("prompt_tokens", "prompt tokens", "{:.0f}", plot=False),
)


@functools.cache
def _tokenizer(model: Path) -> Any:
    from transformers import AutoTokenizer  # slow to import: only when prompts are made

    return AutoTokenizer.from_pretrained(str(model))


def prompt_ids(model: Path, question: rag.Question, order: Sequence[str]) -> list[int]:
    """One question's prompt in the model's chat template, as vLLM's chat endpoint makes it."""
    tok = _tokenizer(model)
    text = tok.apply_chat_template(rag.messages(question, order), add_generation_prompt=True, tokenize=False)
    return list(tok.encode(text, add_special_tokens=False))


def answer_record(model: Path, question: rag.Question, done: Any) -> dict[str, Any]:
    """One streamed answer (``client.Streamed``): its text, whether it is right, its tokens, TTFT
    and the prompt tokens a cache supplied."""
    text = _tokenizer(model).decode(done.token_ids, skip_special_tokens=True)
    return {
        "question": question.key,
        "text": text,
        "correct": rag.is_correct(text, question),
        "token_ids": list(done.token_ids),
        "ttft_ms": done.ttft * 1e3,
        "cached_tokens": done.cached_tokens,
        "prompt_tokens": done.prompt_tokens,
    }


def common_prefix(prompts: Sequence[Sequence[int]]) -> list[int]:
    """The tokens every prompt starts with (the system prompt and the documents)."""
    first = prompts[0]
    n = min(len(p) for p in prompts)
    for i in range(n):
        if any(p[i] != first[i] for p in prompts):
            return list(first[:i])
    return list(first[:n])


def agreement(records: Records, reference: str) -> None:
    """Adds to each record the agreement of its answers with ``reference``'s in the same
    repetition (``full``'s own records: with its first repetition, a repeatability check)."""
    for by_mode in records.values():
        refs = {r["repetition"]: r for r in by_mode.get(reference, [])}
        prefix = {r["repetition"]: r for r in by_mode.get("none", [])}
        for mode, recs in by_mode.items():
            for rec in recs:
                ref = refs.get(0 if mode == reference else rec["repetition"])
                if ref is not None:
                    pairs = list(zip(ref["answers"], rec["answers"], strict=True))
                    rec["exact_vs_full"] = _share(a["token_ids"] == b["token_ids"] for a, b in pairs)
                    rec["tokens_vs_full"] = statistics.fmean(
                        rag.token_agreement(a["token_ids"], b["token_ids"]) for a, b in pairs
                    )
                base = prefix.get(rec["repetition"])
                if base is not None and mode not in ("none", reference):
                    pairs = list(zip(base["answers"], rec["answers"], strict=True))
                    rec["exact_vs_prefix_cache"] = _share(a["token_ids"] == b["token_ids"] for a, b in pairs)


def _as_planned(cached: int, prefix: int, caching: bool) -> bool:
    """Full prefill caches nothing; a cache serves the documents' whole blocks (128 tokens) or
    chunks (KVLens: 256) at least."""
    return cached >= prefix - CHUNK if caching else cached == 0


def _share(flags: Any) -> float:
    flags = list(flags)
    return sum(flags) / len(flags) if flags else float("nan")


class RagQuality(ServedBenchmark):
    name = "rag_quality"
    title = "RAG set on the real model: accuracy and agreement with full prefill, per mode"
    figures = FIGURES
    baselines = ("full",)
    checks = (Check("cache_as_planned", "a question's prompt came from a cache other than the mode's plan"),)
    legend = (
        "accuracy: share of questions answered right; exact x full: share whose generated tokens equal full "
        "prefill's (same repetition; for full itself: its first repetition's); tokens x full: mean share of "
        "tokens equal up to the first difference; exact x vLLM prefix cache: the same against mode none.",
        "cached prompt tokens: per question, from vLLM's prefix cache (none) or KVLens (its cache flushed "
        "before each question); full computes every token.",
    )
    default_modes = "full,none,kvlens"
    quick_modes = default_modes
    kvlens_tiers = "cpu"
    case_label = "document order"
    repeats = (2, 1)
    options = {
        "orders": Option("canonical,shuffled", "canonical", f"document orders, of {', '.join(rag.ORDERS)}"),
        "per_document": Option(4, 1, "questions per document (the first N of each)"),
        "answer_len": Option(32, help="generated tokens at most per answer"),
    }

    def __init__(self, args: Any) -> None:
        if not args.model:
            args.real = True  # the set needs a model that reads
        super().__init__(args)

    @property
    def result_name(self) -> str:
        return self.name

    def questions(self) -> list[rag.Question]:
        return [q for d in rag.DOCUMENTS for q in rag.questions_for(d.key)[: self.args.per_document]]

    def cases(self) -> list[Case]:
        names = [n.strip() for n in self.args.orders.split(",") if n.strip()]
        unknown = [n for n in names if n not in rag.ORDERS]
        if unknown or not names:
            raise SystemExit(
                f"--orders: unknown {', '.join(unknown) or '(none)'}; known: {', '.join(rag.ORDERS)}"
            )
        self.prompts = {
            n: [(q, prompt_ids(self.model, q, rag.ORDERS[n])) for q in self.questions()] for n in names
        }
        return [Case(n, params=rag.ORDERS[n]) for n in names]

    def server_shape(self) -> ServerShape:
        longest = max(len(ids) for prompts in self.prompts.values() for _, ids in prompts)
        return ServerShape(longest + self.args.answer_len + 16, kv_space_gib=1, working_set_gb=0.2)

    def warm_up(self, lm: LiveMode) -> None:
        """One question in another order, unmeasured: the server's first-request costs."""
        ids = prompt_ids(self.model, self.questions()[0], rag.ORDERS["reversed"])
        asyncio.run(self._ask(lm, ids, None))

    def measure(self, lm: LiveMode, case: Case, rep: int) -> dict[str, Any]:
        prompts = self.prompts[case.name]
        prefix = common_prefix([ids for _, ids in prompts])
        caching, connector = lm.mode.prefix_caching, lm.mode.connector is not None
        if caching:  # the documents, computed once: stored by a connector, kept by vLLM
            lm.client.reset_prefix_cache()
            lm.client.complete(prefix)
        answers, planned = [], True
        for q, ids in prompts:
            if connector:
                lm.client.reset_prefix_cache()  # the documents come from the connector
            done = asyncio.run(self._ask(lm, ids, SKIP_SAVE if lm.mode.connector == "kvlens" else None))
            answers.append(answer_record(self.model, q, done))
            planned &= _as_planned(done.cached_tokens, len(prefix), caching)
        return {
            "accuracy": _share(a["correct"] for a in answers),
            "ttft_ms": [a["ttft_ms"] for a in answers],
            "cached_tokens": [a["cached_tokens"] for a in answers],
            "prompt_tokens": [a["prompt_tokens"] for a in answers],
            "documents_prefix_tokens": len(prefix),
            "cache_as_planned": planned,
            "answers": answers,
        }

    async def _ask(self, lm: LiveMode, ids: list[int], kv: dict[str, Any] | None) -> Any:
        async with aiohttp.ClientSession() as session:
            return await stream(
                session, lm.server.url, ids, self.args.answer_len, kv_params=kv, ignore_eos=False
            )

    def report(self, records: Any) -> None:
        agreement(records, "full")
        super().report(records)

    def workload(self) -> dict[str, Any]:
        return {
            "questions": [q.key for q in self.questions()],
            "orders": {n: list(rag.ORDERS[n]) for n in self.prompts},
            "documents_prefix_tokens": {
                n: len(common_prefix([ids for _, ids in p])) for n, p in self.prompts.items()
            },
            "answer_len": self.args.answer_len,
        }


if __name__ == "__main__":
    sys.exit(main(RagQuality))
