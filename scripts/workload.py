#!/usr/bin/env python3
"""Shared-prefix workload against a running vLLM OpenAI-compatible server (stdlib only).

    python scripts/workload.py [--url http://127.0.0.1:8000] [--rounds 3] [--questions 4]

Every request is one long shared system prompt (~1000 tokens) followed by a different
question, sent greedily (temperature 0, max_tokens 16) to /v1/completions, one at a time.
Before every round after the first, POST /reset_prefix_cache flushes vLLM's own prefix cache
(the server needs VLLM_SERVER_DEV_MODE=1), so in later rounds reused tokens come from the KV
connector (KVLens) and not from vLLM's local cache. Use ``--reset request`` to flush before
every request instead, so that every reused token must come from the connector.

For each request it prints the round, prompt tokens, ``usage.prompt_tokens_details.
cached_tokens`` (all tokens vLLM did not compute: its own prefix-cache hits plus tokens loaded
by the connector; the server needs --enable-prompt-tokens-details), ``kv_transfer_params.
num_lmcache_cached_tokens`` (tokens the connector had; "-" when absent) and latency, then a
summary. Greedy outputs of the same prompt must be identical in every round.

Exit status: 0 ok; 1 outputs differ between rounds; 2 server/HTTP error; 3 ``--expect-kvlens``
given but no connector-provided tokens were reported after round 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request

PARAGRAPHS = [
    "You are the support assistant of Northwind Outfitters, a company that sells tents, "
    "sleeping bags, backpacks, stoves and clothing for hiking and camping. You answer "
    "customers politely, briefly and accurately, using only the policies below. When a policy "
    "does not cover a question, say so and offer to forward the question to a human agent.",
    "Orders. Orders placed before two o'clock in the afternoon on a working day are packed "
    "the same day. Standard delivery takes three to five working days within the country and "
    "costs four dollars ninety, or nothing for orders above fifty dollars. Express delivery "
    "takes one to two working days and costs twelve dollars. Orders to islands and remote "
    "areas may take two extra days. Customers receive a tracking number by email when the "
    "parcel leaves the warehouse.",
    "Returns. Unused items in their original packaging may be returned within thirty days of "
    "delivery for a full refund. Tents and sleeping bags that were used may be returned within "
    "fourteen days if they are clean and dry; a cleaning fee of fifteen dollars is deducted. "
    "Refunds are paid to the original payment method within seven working days after the "
    "return arrives. Sale items marked as final sale cannot be returned, only exchanged.",
    "Warranty. Every product has a two year warranty against manufacturing defects. Backpacks "
    "and stoves of the Summit series have a lifetime warranty. The warranty does not cover "
    "normal wear, damage caused by accidents, fire or animals, or repairs made by third "
    "parties. To make a claim, customers send a photo of the defect and the order number; the "
    "repair team answers within three working days and either repairs or replaces the item.",
    "Sizes. Clothing runs true to size. Between two sizes, customers should choose the larger "
    "one for jackets and the smaller one for base layers. Hiking boots should be one half size "
    "larger than street shoes, to leave room for thick socks and for the feet swelling on long "
    "walks. Sleeping bags come in regular and long; the long model fits people taller than one "
    "metre eighty five.",
    "Care. Tents must be dried completely before storage, away from direct sunlight. Down "
    "sleeping bags are washed by hand or in a front loading machine with a special down soap, "
    "then tumble dried at low heat with two clean tennis balls. Waterproof jackets recover "
    "their water repellency after a warm tumble dry. Stoves are cleaned with a soft brush; "
    "the fuel line must never be oiled.",
    "Loyalty programme. Members collect one point per dollar spent. One hundred points are "
    "worth a five dollar voucher. Members get free standard delivery on every order, early "
    "access to sales and an extra fifteen days for returns. Points expire two years after they "
    "were earned. Membership is free and can be cancelled at any time from the account page.",
    "Stores. The flagship store in Portland is open from nine to seven on weekdays and from ten "
    "to five on Saturdays; it is closed on Sundays and public holidays. Smaller stores in "
    "Denver, Boise and Salt Lake City keep the same hours but close at six on weekdays. All "
    "stores offer free fitting of backpacks and boots, and rent tents and stoves by the week.",
    "Safety. Never use a stove or a heater inside a closed tent: carbon monoxide can kill "
    "without warning. Always tell someone where you are going and when you expect to be back. "
    "Carry a map, a compass, a first aid kit, a head torch, extra food, water and warm "
    "clothes, even on short day walks, because the weather in the mountains changes quickly.",
    "Tone. Greet the customer once, answer the question in two or three sentences, and end "
    "with a short offer of further help. Do not use marketing language, do not promise "
    "delivery dates that the policies above do not support, and never ask for full card "
    "numbers or passwords.",
]

QUESTIONS = [
    "How long does express delivery take?",
    "Can I return a sleeping bag that I used on one trip?",
    "What does the warranty of the Summit stove cover?",
    "Which size of hiking boots should I buy?",
    "How do I wash a down sleeping bag?",
    "When is the Denver store open on Saturdays?",
    "How many points do I need for a five dollar voucher?",
    "Is it safe to cook inside my tent when it rains?",
]


class ServerError(Exception):
    pass


def http(url: str, body: dict | None = None, timeout: float = 120.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url,
        data=data,
        method="GET" if body is None else "POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        raise ServerError(f"{req.method} {url}: HTTP {e.code}: {e.read()[:500]!r}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ServerError(f"{req.method} {url}: {e}") from None
    return json.loads(raw) if raw.strip() else {}


def count_tokens(base: str, model: str, text: str) -> int | None:
    try:
        return int(http(f"{base}/tokenize", {"model": model, "prompt": text})["count"])
    except (ServerError, KeyError, ValueError):
        return None


def build_system_prompt(base: str, model: str, target_tokens: int) -> tuple[str, int | None]:
    """Concatenate PARAGRAPHS (cycling) until the server's tokenizer counts target_tokens."""
    text, n, i = "", None, 0
    while True:
        text += PARAGRAPHS[i % len(PARAGRAPHS)] + "\n\n"
        i += 1
        n = count_tokens(base, model, text)
        if n is None:  # no /tokenize: ~3.5 characters per token for the tiny model
            if len(text) >= target_tokens * 3.5:
                return text, None
        elif n >= target_tokens:
            return text, n
        if i > 20 * len(PARAGRAPHS):
            return text, n


def reset_prefix_cache(base: str, attempts: int = 20) -> bool:
    """Flush vLLM's local prefix cache (not the connector's). Retries while blocks are held."""
    for _ in range(attempts):
        try:
            if http(f"{base}/reset_prefix_cache", {}).get("success", True):
                return True
        except ServerError as e:
            if "HTTP 404" in str(e):
                raise ServerError(
                    "POST /reset_prefix_cache is not available: start vLLM with VLLM_SERVER_DEV_MODE=1"
                ) from None
            raise
        time.sleep(0.25)
    return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--model", help="model name (default: the first of /v1/models)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--questions", type=int, default=4, help=f"1..{len(QUESTIONS)}")
    p.add_argument(
        "--prefix-tokens", type=int, default=1000, help="size of the shared system prompt in tokens"
    )
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument(
        "--reset",
        choices=("round", "request", "never"),
        default="round",
        help="when to flush vLLM's own prefix cache",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout (s)")
    p.add_argument(
        "--expect-kvlens",
        action="store_true",
        help="fail (exit 3) unless the connector reported reused tokens after round 1",
    )
    p.add_argument("--json", metavar="FILE", help="also write every result as JSON to FILE")
    args = p.parse_args(argv)
    base = args.url.rstrip("/")
    n_q = max(1, min(args.questions, len(QUESTIONS)))

    try:
        model = args.model or http(f"{base}/v1/models")["data"][0]["id"]
        system, sys_tokens = build_system_prompt(base, model, args.prefix_tokens)
        print(
            f"model {model}; shared system prompt: "
            f"{sys_tokens if sys_tokens is not None else '?'} tokens, {len(system)} chars; "
            f"{args.rounds} rounds x {n_q} questions; reset vLLM prefix cache: {args.reset}"
        )
        print(f"{'round':>5} {'q':>2} {'prompt':>6} {'cached':>6} {'kvlens':>6} {'latency':>8}  output")
        results = []
        for rnd in range(1, args.rounds + 1):
            if args.reset == "round" and rnd > 1 and not reset_prefix_cache(base):
                print("warning: /reset_prefix_cache kept failing (blocks still held)")
            for qi in range(n_q):
                if args.reset == "request" and not reset_prefix_cache(base):
                    print("warning: /reset_prefix_cache kept failing (blocks still held)")
                prompt = f"{system}Customer: {QUESTIONS[qi]}\nAssistant:"
                body = {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": args.max_tokens,
                    "temperature": 0.0,
                    "seed": 0,
                }
                t0 = time.perf_counter()
                resp = http(f"{base}/v1/completions", body, timeout=args.timeout)
                latency = time.perf_counter() - t0
                usage = resp.get("usage") or {}
                details = usage.get("prompt_tokens_details") or {}
                kvp = resp.get("kv_transfer_params") or {}
                rec = {
                    "round": rnd,
                    "question": qi,
                    "prompt_tokens": usage.get("prompt_tokens"),
                    "cached_tokens": details.get("cached_tokens"),
                    "kvlens_tokens": kvp.get("num_lmcache_cached_tokens"),
                    "latency_s": latency,
                    "text": resp["choices"][0]["text"],
                }
                results.append(rec)
                print(
                    f"{rnd:>5} {qi + 1:>2} {_fmt(rec['prompt_tokens']):>6} "
                    f"{_fmt(rec['cached_tokens']):>6} {_fmt(rec['kvlens_tokens']):>6} "
                    f"{latency:>7.3f}s  {rec['text'][:40]!r}",
                    flush=True,
                )
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    return summarize(results, args)


def _fmt(v) -> str:
    return "-" if v is None else str(v)


def summarize(results: list[dict], args) -> int:
    rounds = sorted({r["round"] for r in results})
    print("summary:")
    for rnd in rounds:
        rs = [r for r in results if r["round"] == rnd]
        prompt = sum(r["prompt_tokens"] or 0 for r in rs)
        cached = sum(r["cached_tokens"] or 0 for r in rs)
        kv = [r["kvlens_tokens"] for r in rs if r["kvlens_tokens"] is not None]
        lat = sorted(r["latency_s"] for r in rs)
        print(
            f"  round {rnd}: {prompt} prompt tokens, {cached} cached "
            f"({100.0 * cached / max(prompt, 1):.0f}%), kvlens "
            f"{sum(kv) if kv else '-'}, latency mean {sum(lat) / len(lat):.3f}s "
            f"median {lat[len(lat) // 2]:.3f}s"
        )
    later = [r for r in results if r["round"] > 1]
    if later:
        prompt = sum(r["prompt_tokens"] or 0 for r in later)
        cached = sum(r["cached_tokens"] or 0 for r in later)
        kv = [r["kvlens_tokens"] for r in later if r["kvlens_tokens"] is not None]
        first = [r["latency_s"] for r in results if r["round"] == 1]
        rest = [r["latency_s"] for r in later]
        speedup = (sum(first) / len(first)) / max(sum(rest) / len(rest), 1e-9)
        print(
            f"  rounds 2..{rounds[-1]}: reused {cached} of {prompt} prompt tokens "
            f"({100.0 * cached / max(prompt, 1):.0f}%); KVLens had "
            f"{sum(kv) if kv else '-'} tokens of them; mean latency {speedup:.2f}x faster than round 1"
        )

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)

    status = 0
    by_q: dict[int, list[dict]] = {}
    for r in results:
        by_q.setdefault(r["question"], []).append(r)
    bad = [q for q, rs in by_q.items() if len({r["text"] for r in rs}) > 1]
    if bad:
        status = 1
        for q in bad:
            print(f"MISMATCH: question {q + 1} produced different outputs across rounds:")
            for r in by_q[q]:
                print(f"    round {r['round']}: {r['text']!r}")
    else:
        print(f"outputs identical across rounds for all {len(by_q)} prompts")
    if args.expect_kvlens and not any((r["kvlens_tokens"] or 0) > 0 for r in later):
        print("FAIL: --expect-kvlens: the connector reported no reused tokens after round 1")
        status = status or 3
    return status


if __name__ == "__main__":
    sys.exit(main())
