"""Time to first token with KVLens (CPU tier), as ratios measured side by side in one engine.

    source scripts/env.sh && .venv/bin/python bench/prefix_reuse.py [--model DIR] [--tokens 3000]

For each of several distinct prompts: cold (computed, KVLens stores), vLLM's own prefix hit
(the floor), and a KVLens hit after vLLM's prefix cache is flushed. Reports medians and the
ratios hit/floor and cold/hit. Build a bigger model first for meaningful numbers, e.g.
`python scripts/tiny_model.py /tmp/bench-model --layers 8 --hidden 1024 --heads 16 --kv-heads 8`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def tier_config(args: argparse.Namespace) -> dict[str, object]:
    config: dict[str, object] = {"lmcache.chunk_size": args.chunk_size, "lmcache.max_local_cpu_size": 2}
    if args.disk:
        config.update({"lmcache.local_cpu": False, "lmcache.local_disk": args.disk})
        config["lmcache.max_local_disk_size"] = 4
    return config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=".run/tiny-model")
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--disk", help="use only a local-disk tier in this directory")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=args.tokens + 64,
        dtype="bfloat16",
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVLensConnector",
            kv_connector_module_path="connector",
            kv_role="kv_both",
            kv_connector_extra_config=tier_config(args),
        ),
    )
    vocab = llm.llm_engine.model_config.get_vocab_size()
    one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)

    def ttft(prompt: list[int]) -> tuple[float, int]:
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], one, use_tqdm=False)[0]
        return time.perf_counter() - t, out.num_cached_tokens

    ttft([1, 2, 3])  # warm-up
    cold, floor, hit = [], [], []
    for i in range(args.repeats):
        rng = random.Random(100 + i)
        prompt = [rng.randrange(10, vocab - 1) for _ in range(args.tokens)]
        cold.append(ttft(prompt)[0])
        floor.append(ttft(prompt)[0])
        llm.reset_prefix_cache()
        t, cached = ttft(prompt)
        hit.append(t)
        llm.reset_prefix_cache()
        print(
            f"prompt {i}: cold {cold[-1]:.3f}s  vLLM hit {floor[-1]:.3f}s"
            f"  KVLens hit {t:.3f}s ({cached} tokens)"
        )
    c, f, h = (statistics.median(x) for x in (cold, floor, hit))
    print(f"median TTFT: cold {c:.3f}s, vLLM prefix hit {f:.3f}s, KVLens hit {h:.3f}s")
    print(f"KVLens hit / vLLM hit = {h / f:.2f}   cold / KVLens hit = {c / h:.1f}x")


if __name__ == "__main__":
    main()
