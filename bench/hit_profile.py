"""Where a KVLens hit's time goes, against vLLM's own prefix-cache hit, in one offline engine.

    python bench/hit_profile.py [--quick] [--pairs 15] [--tokens 3000] [--layerwise true|false]

No HTTP, no API server: one ``vllm.LLM`` with its engine core and worker in this process, so
the worker's hooks can be timed from the inside. For each pair: the prompt's vLLM prefix-cache
hit (the floor), then ``reset_prefix_cache()`` and the same prompt again, now loaded by KVLens.
Per hit it records how long the worker's thread was held by KVLens: reading and checking the
chunks (``start_load_kv``), waiting for layers still being copied (``wait_for_layer_load``,
summed over layers), the step's end (``wait_for_save``), KVLens's scheduler hooks, and the
model forward as a whole. Run it once per ``--layerwise`` value for the A/B, and once with
``--floor-beside-copy-mb 47`` for the control: a plain copy of the same bytes on another
thread during the floor request shows what memory traffic beside the forward pass costs it.
Prints a table and writes hit_profile-layerwise-<value>.json (see --out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from connector.cpu_affinity import run_beside_worker  # noqa: E402


def timed_method(obj: object, name: str, into: list[float]) -> None:
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            into[-1] += time.perf_counter() - started

    setattr(obj, name, wrapper)


def _copy_beside(megabytes: float) -> threading.Thread | None:
    """Start copying ``megabytes`` on another thread, in 8 pieces (one per layer)."""
    if megabytes <= 0:
        return None
    src = np.ones(int(megabytes * 1e6 / 8 / 8), dtype=np.int64)
    dst = np.zeros_like(src)

    def copy() -> None:
        run_beside_worker()
        for _ in range(8):
            np.copyto(dst, src)

    thread = threading.Thread(target=copy)
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model, 3 pairs: keeps the script working")
    p.add_argument("--pairs", type=int, default=15)
    p.add_argument("--tokens", type=int, default=3000)
    p.add_argument("--layerwise", choices=("true", "false"), default="true")
    p.add_argument(
        "--floor-beside-copy-mb",
        type=float,
        default=0.0,
        help="the control: during each floor request, copy this many MB (in 8 pieces, one thread, "
        "no GIL) beside it, as KVLens's copy thread does during a hit",
    )
    p.add_argument("--model", help="model directory (default: the ttft_peers model, built once)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / ".run" / "bench" / "results"))
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from bench.lib import models

    if args.quick:
        args.pairs, args.tokens = 3, 1000
    model = args.model or str(models.ensure_model(models.TINY if args.quick else models.BENCH))
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=max(4096, args.tokens + 16),
        enable_prefix_caching=True,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVLensConnector",
            kv_connector_module_path="connector",
            kv_role="kv_both",
            kv_connector_extra_config={"lmcache.use_layerwise": args.layerwise == "true"},
        ),
    )
    connector = get_kv_transfer_group()
    core = llm.llm_engine.engine_core.engine_core
    blocked = {"start_load_kv": [0.0], "wait_for_layer_load": [0.0], "wait_for_save": [0.0]}
    for hook, into in blocked.items():
        timed_method(connector, hook, into)
    scheduler_hooks = (
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "update_connector_output",
        "request_finished",
    )
    blocked["scheduler hooks"] = [0.0]
    for hook in scheduler_hooks:
        timed_method(core.scheduler.connector, hook, blocked["scheduler hooks"])
    blocked["model forward"] = [0.0]
    timed_method(core.model_executor, "execute_model", blocked["model forward"])
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    rng = random.Random(7)
    vocab = models.vocab_size(Path(model))
    rows = []

    def ttft(prompt: TokensPrompt) -> tuple[float, int]:
        for into in blocked.values():
            into.append(0.0)
        started = time.perf_counter()
        (out,) = llm.generate([prompt], greedy, use_tqdm=False)
        return time.perf_counter() - started, out.num_cached_tokens or 0

    for _ in range(args.pairs + 1):  # the first pair warms up
        prompt = TokensPrompt(prompt_token_ids=[rng.randrange(100, vocab) for _ in range(args.tokens)])
        ttft(prompt)  # cold: KVLens stores
        connector._worker.flush()
        beside = _copy_beside(args.floor_beside_copy_mb)
        floor, floor_cached = ttft(prompt)
        if beside is not None:
            beside.join()
        llm.reset_prefix_cache()
        hit, hit_cached = ttft(prompt)
        rows.append(
            {
                "floor_s": floor,
                "hit_s": hit,
                "ratio": hit / floor,
                "floor_cached": floor_cached,
                "hit_cached": hit_cached,
                **{f"{hook}_ms": into[-1] * 1e3 for hook, into in blocked.items()},
                **{f"floor_{hook}_ms": into[-2] * 1e3 for hook, into in blocked.items()},
            }
        )
    rows = rows[1:]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    summary = {key: med(key) for key in rows[0]}
    summary["ratio_min"] = min(r["ratio"] for r in rows)
    summary["ratio_max"] = max(r["ratio"] for r in rows)
    summary["gap_ms"] = statistics.median((r["hit_s"] - r["floor_s"]) * 1e3 for r in rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"hit_profile-layerwise-{args.layerwise}.json").write_text(
        json.dumps({"settings": vars(args) | {"model": model}, "summary": summary, "pairs": rows}, indent=1)
    )
    print(f"use_layerwise={args.layerwise}  {args.tokens}-token prompts, {len(rows)} pairs (medians)")
    print(
        f"  floor {summary['floor_s'] * 1e3:.1f} ms, KVLens hit {summary['hit_s'] * 1e3:.1f} ms, "
        f"gap {summary['gap_ms']:.1f} ms"
    )
    print(f"  hit / floor {summary['ratio']:.3f} ({summary['ratio_min']:.3f}..{summary['ratio_max']:.3f})")
    print(f"  cached tokens: floor {summary['floor_cached']:.0f}, hit {summary['hit_cached']:.0f}")
    print("  time per hit (floor in brackets): KVLens's worker hooks, its scheduler hooks, the forward")
    for hook in blocked:
        print(f"    {hook:<20} {summary[f'{hook}_ms']:7.2f} ms  ({summary[f'floor_{hook}_ms']:.2f})")


if __name__ == "__main__":
    main()
