"""Time to first token on one long prompt, per KV-cache connector, side by side (the headline).

    python bench/ttft_peers.py [--quick] [--modes none,kvlens,example,lmcache] [--kvlens-tiers cpu,disk]

Every mode is a vLLM server on the same model and worker core. For each of --prompts prompts of
--tokens random token ids, in every mode in turn (bench/lib/ttft.py):

* cold: the prompt's first request (a connector stores its KV);
* --pairs back-to-back pairs: the floor (vLLM's own prefix-cache hit on the prompt), then
  ``POST /reset_prefix_cache`` and the connector's hit (vLLM's cache is empty, so the prefix
  comes from the connector, or is recomputed without one). Each hit is divided by the floor
  measured just before it: the ratio does not depend on how busy the machine was that minute.

Then, for KVLens modes, the cost of storing on a miss: --store-pairs pairs of cold requests on
fresh prompts in the same engine, one stored as usual and one with ``kv_transfer_params:
{"lmcache.skip_save": true}``, in alternating order; and KVLens's own store timer from /metrics.

Targets: KVLens hit <= 1.01 x floor; cold with stores <= 1.01 x cold without.
Prints the tables; writes .run/bench/results/ttft_peers.json and .png (see --out).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib import ttft  # noqa: E402
from bench.lib.models import kv_bytes_per_token  # noqa: E402
from bench.lib.runner import Case, Check, Figure, Option, Target, main  # noqa: E402
from bench.lib.served import LiveMode, ServedBenchmark, ServerShape  # noqa: E402

CPU_MODE = "kvlens-cpu"
DISK_TARGET = 1.05


class TtftPeers(ServedBenchmark):
    name = "ttft_peers"
    title = "TTFT of one long prompt per connector: cold, vLLM prefix hit (floor), connector hit"
    # hit/floor of a slower KVLens tier is also divided by the CPU tier's, prompt by prompt
    figures = (
        *(dataclasses.replace(f, ratio=True) if f is ttft.PAIR_RATIO else f for f in ttft.FIGURES),
        Figure("store_over_skip", "stored/unstored cold", panel="cost of storing on a miss"),
        Figure("store_timer_ms", "store timer ms", "{:.1f}", plot=False),
    )
    checks = (
        *ttft.HIT_CHECKS,
        Check("skip_save_honoured", "a skip_save request was not reported as skipped"),
    )
    targets = (
        ttft.HIT_GOAL,
        Target(
            f"KVLens disk hit <= {DISK_TARGET} x CPU-tier hit (hit/floor over kvlens-cpu's)",
            "pair_ratio",
            DISK_TARGET,
            baseline=CPU_MODE,
            mode_prefix="kvlens-disk",
        ),
        Target(
            f"cold with stores <= {ttft.STORE_TARGET} x without",
            "store_over_skip",
            ttft.STORE_TARGET,
            mode_prefix="kvlens",
        ),
    )
    legend = ttft.LEGEND
    repeats = (3, 1)
    repeat_flags = ("--prompts",)  # each repetition is a prompt of its own
    seed = 5
    options = {
        "tokens": Option(
            3000,
            1000,
            "prompt length (not a multiple of 128: vLLM and the connectors then reuse the same whole blocks)",
        ),
        "pairs": Option(5, 2, "floor/hit pairs per prompt"),
        "store_pairs": Option(6, 2, "stored/skip-save cold pairs per KVLens mode"),
    }

    def server_shape(self) -> ServerShape:
        a = self.args
        prompts = 1 + a.repeats + 2 * a.store_pairs  # the warm-up's, the measured, the store pairs'
        stored = prompts * a.tokens * kv_bytes_per_token(self.model) / 1e9
        return ServerShape(a.tokens + 64, kv_space_gib=1, working_set_gb=stored)

    def cases(self) -> list[Case]:
        return [Case("all", repeats=max(self.args.repeats, self.args.store_pairs))]

    def warm_up(self, lm: LiveMode) -> None:
        # A full-length prompt of its own: the first prefill of a length pays one-off costs (kernel
        # set-up, allocations) that must not land in the first mode's cold figure.
        ttft.warm_up(lm.client, ttft.prompt(self.args.seed * 1000 - 1, self.args.tokens, self.vocab))

    def measure(self, lm: LiveMode, case: Case, rep: int) -> dict[str, Any]:
        a, rec = self.args, {}
        if rep < a.repeats:
            rec = ttft.measure_prompt(lm, ttft.prompt(a.seed * 1000 + rep, a.tokens, self.vocab), a.pairs)
        if rep < a.store_pairs and lm.mode.connector == "kvlens":
            stored, skipped = (ttft.prompt(a.seed * 7919 + 2 * rep + i, a.tokens, self.vocab) for i in (0, 1))
            rec |= ttft.measure_store_pair(lm, stored, skipped, store_first=rep % 2 == 0)
        return rec

    def compared_with(self, side: str) -> Sequence[str]:
        names = {m.name for m in self.modes}
        return (CPU_MODE,) if side.startswith("kvlens-") and side != CPU_MODE and CPU_MODE in names else ()

    def workload(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.args.tokens,
            "prompts": self.args.repeats,
            "pairs_per_prompt": self.args.pairs,
        }


if __name__ == "__main__":
    sys.exit(main(TtftPeers))
