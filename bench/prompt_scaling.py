"""Time to first token as the prompt grows from 1k to 32k tokens, per KV-cache connector.

    python bench/prompt_scaling.py [--quick] [--lengths 1000,2000,4000,8000,16100,32100]
                                   [--modes none,kvlens,example,lmcache] [--kvlens-tiers cpu]

The headline (ttft_peers.py) measures one prompt length; a connector's hit can keep up with
vLLM's own prefix hit at 3k tokens and still fall behind at 32k, where a hit moves ten times
the KV (512 MiB at 16 KiB a token) while the floor it is compared with barely grows. Every
mode is a vLLM server on the same model (``BENCH_32K``: BENCH with 32k positions) and worker
core. For each length, one prompt of random token ids (a new one per --repeats), in every mode
in turn, the order reversed every other length: cold, then --pairs floor/flush/hit pairs, as
in ttft_peers.py (bench/lib/ttft.py).

Each server is warmed up once, on a prompt of the shortest length, so that lazy set-up does not
land in its first figure; a length's one-off costs (new kernel shapes) land in every mode's
cold request alike. Lengths are not multiples of 128 (vLLM's CPU block; hence 16100, not
16000), so vLLM and the connectors reuse the same whole blocks: on a whole number of blocks
vLLM's own hit recomputes the last block while KVLens serves all but the last token, and the
"floor" is then partly KVLens's.

Target: KVLens hit <= 1.01 x floor at every length.
Prints the tables; writes .run/bench/results/prompt_scaling.json and .png (see --out).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib import ttft  # noqa: E402
from bench.lib.models import BENCH_32K, kv_bytes_per_token  # noqa: E402
from bench.lib.runner import Case, Option, main  # noqa: E402
from bench.lib.served import LiveMode, ServedBenchmark, ServerShape  # noqa: E402
from bench.lib.workload import VLLM_CPU_BLOCK  # noqa: E402

HEADROOM_TOKENS = 64  # --max-model-len above the longest prompt (the generated token)
PLOTTED = {
    "pair_ratio": "",
    "cold_over_hit": "",
    "hit_s": "hit after the flush (none: a recompute)",
    "floor_s": "floor: vLLM's own prefix hit",
}


class PromptScaling(ServedBenchmark):
    name = "prompt_scaling"
    title = "TTFT vs prompt length per connector"
    figures = tuple(
        dataclasses.replace(f, plot=f.key in PLOTTED, panel=PLOTTED.get(f.key, ""), log=f.key != "pair_ratio")
        for f in ttft.FIGURES
    )
    checks = ttft.HIT_CHECKS
    targets = (dataclasses.replace(ttft.HIT_GOAL, text=f"{ttft.HIT_GOAL.text} at every length"),)
    legend = ttft.LEGEND
    case_label = "tokens"
    repeats = (1, 1)
    quick_modes = "none,kvlens,lmcache"
    full_spec = BENCH_32K
    seed = 11
    options = {
        "lengths": Option(
            "1000,2000,4000,8000,16100,32100", "500,1500", "comma-separated prompt lengths in tokens"
        ),
        "pairs": Option(3, 1, "floor/hit pairs per length and mode"),
    }

    @functools.cached_property
    def lengths(self) -> list[int]:
        """Distinct positive lengths, shortest first (the order of the table and the plot)."""
        text = self.args.lengths
        try:
            lengths = sorted({int(x) for x in text.split(",") if x.strip()})
        except ValueError:
            raise SystemExit(f"--lengths: not a comma-separated list of integers: {text!r}") from None
        if not lengths or lengths[0] <= 0:
            raise SystemExit(f"--lengths: need positive token counts, got {text!r}")
        return lengths

    def cases(self) -> list[Case]:
        return [Case(str(n), n) for n in self.lengths]

    def server_shape(self) -> ServerShape:
        """Every server takes the longest prompt: its length, and KV memory for it with room to
        spare (whole GiB, twice its KV); the working set (every prompt's KV, which a connector ends
        up holding) sizes the memory estimate."""
        longest, limit = max(self.lengths), _max_positions(self.model)
        if longest + HEADROOM_TOKENS > limit:
            raise SystemExit(
                f"the longest prompt ({longest} tokens) + {HEADROOM_TOKENS} exceeds the model's "
                f"max_position_embeddings ({limit}); pass shorter --lengths or another --model"
            )
        aligned = [n for n in self.lengths if n % VLLM_CPU_BLOCK == 0]
        if aligned:
            self.note(
                f"lengths {aligned} are whole {VLLM_CPU_BLOCK}-token blocks: vLLM's own hit recomputes the "
                "last block, a connector may serve it, so the floor there is not vLLM's alone"
            )
        per_token = kv_bytes_per_token(self.model)
        kv_gib = max(1, math.ceil(2 * longest * per_token / 2**30))
        working_set = (sum(self.lengths) * self.args.repeats + min(self.lengths)) * per_token / 1e9
        self.shape = ServerShape(longest + HEADROOM_TOKENS, kv_space_gib=kv_gib, working_set_gb=working_set)
        return self.shape

    def warm_up(self, lm: LiveMode) -> None:
        ttft.warm_up(lm.client, ttft.prompt(self.args.seed * 100_003 - 1, self.lengths[0], self.vocab))

    def measure(self, lm: LiveMode, case: Case, rep: int) -> dict[str, Any]:
        n = case.params
        seed = self.args.seed * 100_003 + n + rep * 7_919_000
        return ttft.measure_prompt(lm, ttft.prompt(seed, n, self.vocab), self.args.pairs)

    def workload(self) -> dict[str, Any]:
        server = {"max_model_len": self.shape.max_model_len, "kv_space_gib": self.shape.kv_space_gib}
        return {"lengths": self.lengths, "pairs_per_length": self.args.pairs, "server": server}


def _max_positions(model: Path) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["max_position_embeddings"])


if __name__ == "__main__":
    sys.exit(main(PromptScaling))
