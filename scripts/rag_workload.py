#!/usr/bin/env python3
"""The demo's workload on a real model: questions about short documents, answered in words.

    python scripts/rag_workload.py [--url http://127.0.0.1:8000] [--rounds 3] [--questions 6]

Every request is a chat (/v1/chat/completions, greedy): a shared system prompt, then the
documents of ``bench/lib/rag_set.py`` (invented facts: a ferry line, a library, a kettle, ...),
then one question about one of them. The documents are the prefix every question shares, the
part KVLens stores once and hands back. Before every round after the first, vLLM's own prefix
cache is flushed (POST /reset_prefix_cache; the server needs VLLM_SERVER_DEV_MODE=1), so the
first question of a later round gets the documents' KV from KVLens and the others from vLLM's
cache, which the first one refilled (``--reset request``: every question from KVLens).

For each answer it prints the round, where the prompt's tokens came from (computed; found in
vLLM's own prefix cache; loaded by KVLens, from ``kv_transfer_params.kvlens.loaded_tokens``;
the server needs --enable-prompt-tokens-details), the latency, whether the answer holds the
known fact, and the answer. The summary also counts ``num_lmcache_cached_tokens``, LMCache's
field: the prompt tokens KVLens had, whoever supplied them. Greedy answers must be identical in
every round. Exit status as scripts/workload.py's (0 ok, 1 answers differ between rounds, 2 server error, 3
``--expect-kvlens`` and KVLens supplied nothing after round 1).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib import rag_set  # noqa: E402
from scripts.workload import ServerError, http, reset_prefix_cache, summarize  # noqa: E402


def demo_questions(n: int) -> list[rag_set.Question]:
    """The first question about each document, then the second about each, ... (n of them)."""
    by_document: dict[str, list[rag_set.Question]] = {}
    for q in rag_set.QUESTIONS:
        by_document.setdefault(q.document, []).append(q)
    ordered = [
        qs[i]
        for i in range(max(map(len, by_document.values())))
        for qs in by_document.values()
        if i < len(qs)
    ]
    return ordered[: max(1, n)]


def ask(base: str, model: str, question: rag_set.Question, max_tokens: int, timeout: float) -> dict:
    body = {
        "model": model,
        "messages": rag_set.messages(question),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "seed": 0,
    }
    t0 = time.perf_counter()
    resp = http(f"{base}/v1/chat/completions", body, timeout=timeout)
    latency = time.perf_counter() - t0
    usage = resp.get("usage") or {}
    text = (resp["choices"][0]["message"].get("content") or "").strip()
    params = resp.get("kv_transfer_params") or {}
    loaded = (params.get("kvlens") or {}).get("loaded_tokens")
    return {
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        "kvlens_tokens": params.get("num_lmcache_cached_tokens"),
        "loaded_tokens": sum(loaded.values()) if loaded is not None else None,
        "latency_s": latency,
        "text": text,
        "correct": rag_set.is_correct(text, question),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--model", help="model name (default: the first of /v1/models)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--questions", type=int, default=6, help=f"1..{len(rag_set.QUESTIONS)}")
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--reset", choices=("round", "request", "never"), default="round")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout (s)")
    p.add_argument(
        "--expect-kvlens", action="store_true", help="exit 3 unless KVLens supplied tokens after round 1"
    )
    p.add_argument("--json", metavar="FILE", help="also write every result as JSON to FILE")
    args = p.parse_args(argv)
    base = args.url.rstrip("/")
    questions = demo_questions(args.questions)
    results = []
    try:
        model = args.model or http(f"{base}/v1/models")["data"][0]["id"]
        print(
            f"model {model}: {len(rag_set.DOCUMENTS)} documents shared by every question; "
            f"{args.rounds} rounds x {len(questions)} questions; reset vLLM prefix cache: {args.reset}"
        )
        print("prompt tokens: computed, found in vLLM's prefix cache, loaded by KVLens")
        header = f"{'round':>5} {'q':>2} {'prompt':>6} {'comp':>5} {'vLLM':>5} {'KVLens':>6} {'latency':>8}"
        print(f"{header}  fact  question, then -> answer")
        for rnd in range(1, args.rounds + 1):
            if args.reset == "round" and rnd > 1 and not reset_prefix_cache(base):
                print("warning: /reset_prefix_cache kept failing (blocks still held)")
            for qi, question in enumerate(questions):
                if args.reset == "request" and not reset_prefix_cache(base):
                    print("warning: /reset_prefix_cache kept failing (blocks still held)")
                rec = {
                    "round": rnd,
                    "question": qi,
                    **ask(base, model, question, args.max_tokens, args.timeout),
                }
                results.append(rec)
                fact = "yes" if rec["correct"] else "no"
                computed, from_vllm = split(rec)
                print(
                    f"{rnd:>5} {qi + 1:>2} {_fmt(rec['prompt_tokens']):>6} {computed:>5} {from_vllm:>5} "
                    f"{_fmt(rec['loaded_tokens']):>6} {rec['latency_s']:>7.3f}s  {fact:>4}  {question.text}",
                    flush=True,
                )
                for line in textwrap.wrap(rec["text"], 88) or ["(empty)"]:
                    print(f"{'':>47}-> {line}")
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    right = sum(r["correct"] for r in results if r["round"] == 1)
    print(
        f"answers holding the known fact: {right} of {len(questions)} (a 135M-parameter model reads weakly)"
    )
    return summarize(results, args)


def split(rec: dict) -> tuple[str, str]:
    """Prompt tokens computed, and found in vLLM's own prefix cache ("-" when not reported)."""
    prompt, cached, loaded = rec["prompt_tokens"], rec["cached_tokens"], rec["loaded_tokens"]
    if None in (prompt, cached, loaded):
        return "-", "-"
    return str(prompt - cached), str(cached - loaded)


def _fmt(v) -> str:
    return "-" if v is None else str(v)


if __name__ == "__main__":
    sys.exit(main())
