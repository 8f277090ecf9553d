"""The blender's compute core against full prefill on the real model, without vLLM's engine.

    python bench/blend_core_quality.py [--prompts 6] [--ratios 0,0.15,0.3,1] [--steps 32]

Each prompt is LMCache's blend flow on the RAG set (``bench/lib/blend_quality.py``): the system
prompt and three documents, each computed alone at position 0 and moved to where it sits, joined
by " # # " with a question about the middle document. For each recompute ratio (check layer 1,
LMCache's default) it prints, against the full prefill of the same prompt in fp32 (transformers'
LlamaForCausalLM, SmolLM2-135M-Instruct): the tokens recomputed, the relative K and V error of the
last 4 layers, the next-token logits' L2 distance and KL, the next token's agreement, the greedy
answer's agreement up to the first difference (``rag_set.token_agreement`` over --steps tokens)
and the answers judged right (``rag_set.is_correct``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib import rag_set  # noqa: E402
from bench.lib.blend_quality import greedy_from_kv, measure, rag_prompt, reused_input  # noqa: E402
from bench.lib.models import real_model_dir  # noqa: E402
from connector.worker.blend.hf_llama import HFLlama, prefill_kv  # noqa: E402


def cases(count: int) -> list[tuple[rag_set.Question, tuple[str, ...]]]:
    """Three neighbouring documents, rotated, with a question about the middle one."""
    keys = rag_set.canonical_order()
    out = []
    for i in range(count):
        order = tuple(keys[(i + j) % len(keys)] for j in range(3))
        out.append((rag_set.questions_for(order[1])[i % 3], order))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--ratios", default="0,0.15,0.3,1")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer, LlamaForCausalLM

    path = str(real_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = HFLlama(LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval())
    ratios = [float(r) for r in args.ratios.split(",")]
    rows: dict[float, list[dict[str, float]]] = {r: [] for r in ratios}
    started, full_right = time.monotonic(), []
    for question, order in cases(args.prompts):
        prompt = rag_prompt(tokenizer, question, order)
        full = prefill_kv(model.model, prompt.token_ids)
        reference = greedy_from_kv(model, full[0], full[1], prompt.token_ids, args.steps)
        full_right.append(float(rag_set.is_correct(tokenizer.decode(reference), question)))
        reused = reused_input(model, prompt)
        print(f"{question.key} {order} {prompt.token_ids.shape[0]} tokens")
        print(f"  full prefill: {tokenizer.decode(reference)!r}")
        for ratio in ratios:
            m = measure(model, reused, full, ratio, args.steps)
            answer = tokenizer.decode(m.greedy)
            rows[ratio].append(
                {
                    "recomputed": m.recomputed / m.tokens,
                    "k_error": m.k_error,
                    "v_error": m.v_error,
                    "logits_l2": m.logits_l2,
                    "logits_kl": m.logits_kl,
                    "next_token": float(m.greedy[0] == reference[0]),
                    "agreement": rag_set.token_agreement(reference, m.greedy),
                    "correct": float(rag_set.is_correct(answer, question)),
                    "deviation_mean": m.check_deviation_mean,
                }
            )
            print(f"  ratio {ratio:<4} recomputed {m.recomputed:>3}/{m.tokens}: {answer!r}")
    seconds = time.monotonic() - started
    print(f"\n{args.prompts} prompts, {seconds:.0f} s; full prefill right: {sum(full_right):.0f}")
    print("means per ratio:")
    names = [
        "recomputed",
        "k_error",
        "v_error",
        "logits_l2",
        "logits_kl",
        "next_token",
        "agreement",
        "correct",
    ]
    print("ratio  " + "  ".join(f"{n:>10}" for n in names))
    for ratio in ratios:
        means = [statistics.fmean(r[n] for r in rows[ratio]) for n in names]
        print(f"{ratio:<6} " + "  ".join(f"{v:>10.4f}" for v in means))


if __name__ == "__main__":
    main()
