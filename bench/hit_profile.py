"""Where a KVLens hit's time goes, against vLLM's own prefix-cache hit, in one offline engine.

    python bench/hit_profile.py [--quick] [--pairs 15] [--tokens 3000] [--layerwise true|false]

No HTTP, no API server: one ``vllm.LLM`` with its engine core and worker in this process, so
the worker's hooks can be timed from the inside. Each pair is a new prompt, computed cold
(KVLens stores it), then its vLLM prefix-cache hit (the floor) and, after
``reset_prefix_cache()``, the same prompt again, now loaded by KVLens (the hit), the two in
turns. Per request it records how long the worker's thread was held by KVLens: reading and
checking the chunks (``start_load_kv``), waiting for layers still being copied
(``wait_for_layer_load``, summed over layers), the step's end (``wait_for_save``), KVLens's
scheduler hooks, and the model forward as a whole. Run it once per ``--layerwise`` value for
the A/B, and once with ``--floor-beside-copy-mb 47`` for the control: a plain copy of the same
bytes on another thread during the floor request shows what memory traffic beside the forward
pass costs it. ``--tier disk`` profiles a disk-tier hit instead.
Writes hit_profile-layerwise-<value>.json (see --out).
"""

from __future__ import annotations

import contextlib
import random
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib import models  # noqa: E402
from bench.lib.offline import CallTimer, kvlens_llm  # noqa: E402
from bench.lib.runner import Benchmark, Case, Figure, Option, Side, main  # noqa: E402
from connector.cpu_affinity import run_beside_worker  # noqa: E402

WORKER_HOOKS = ("start_load_kv", "wait_for_layer_load", "wait_for_save")
SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
)
HOOKS_PANEL = "time per request in KVLens's hooks"


def copy_beside(megabytes: float) -> threading.Thread | None:
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


class HitProfile(Benchmark):
    name = "hit_profile"
    figures = (
        Figure("ttft_ms", "TTFT ms", "{:.1f}", ratio=True),
        Figure("model_forward_ms", "model forward ms", "{:.1f}", ratio=True),
        *(Figure(f"{h}_ms", f"{h} ms", "{:.2f}", panel=HOOKS_PANEL) for h in WORKER_HOOKS),
        Figure("scheduler_hooks_ms", "scheduler hooks ms", "{:.2f}", panel=HOOKS_PANEL),
        Figure("cached_tokens", "cached tokens", "{:.0f}", plot=False),
    )
    baselines = ("floor",)
    repeats = (15, 3)
    repeat_flags = ("--pairs",)
    options = {
        "tokens": Option(3000, 1000, "prompt length"),
        "layerwise": Option("true", help="KVLens's lmcache.use_layerwise", choices=("true", "false")),
        "tier": Option("cpu", help="the tier KVLens loads from", choices=("cpu", "disk")),
        "floor_beside_copy_mb": Option(
            0.0,
            help="the control: during each floor request, copy this many MB "
            "(in 8 pieces, one thread, no GIL) beside it, as KVLens's copy thread does "
            "during a hit",
        ),
        "model": Option(None, help="model directory (default: the benchmark model, built once)"),
    }

    @property
    def result_name(self) -> str:
        return f"{self.name}-layerwise-{self.args.layerwise}"

    def sides(self) -> list[Side]:
        return [Side("floor", "vLLM's own prefix-cache hit"), Side("hit", "KVLens hit after a flush")]

    @contextlib.contextmanager
    def setup(self) -> Iterator[None]:
        from vllm import SamplingParams
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        a = self.args
        self.model = a.model or str(models.ensure_model(models.TINY if self.quick else models.BENCH))
        extra: dict[str, Any] = {"lmcache.use_layerwise": a.layerwise == "true"}
        with tempfile.TemporaryDirectory(prefix="kvlens-hit-profile-") as disk:
            if a.tier == "disk":
                extra |= {
                    "lmcache.local_cpu": False,
                    "lmcache.local_disk": disk,
                    "lmcache.max_local_disk_size": 4,
                }
            max_len = max(4096, a.tokens + 16)
            self.llm = kvlens_llm(self.model, extra, max_model_len=max_len, enable_prefix_caching=True)
            self.connector = get_kv_transfer_group()
            core = self.llm.llm_engine.engine_core.engine_core
            self.timers = {hook: CallTimer().wrap(self.connector, hook) for hook in WORKER_HOOKS}
            self.timers["scheduler_hooks"] = CallTimer().wrap(core.scheduler.connector, *SCHEDULER_HOOKS)
            self.timers["model_forward"] = CallTimer().wrap(core.model_executor, "execute_model")
            self.greedy = SamplingParams(max_tokens=1, temperature=0.0)
            self.rng, self.vocab = random.Random(7), models.vocab_size(Path(self.model))
            self.prompts: dict[int, Any] = {}
            yield

    def ttft(self, prompt: Any) -> dict[str, float]:
        """Time to first token, and the time spent in each hook meanwhile."""
        before = {hook: timer.seconds for hook, timer in self.timers.items()}
        started = time.perf_counter()
        (out,) = self.llm.generate([prompt], self.greedy, use_tqdm=False)
        rec = {"ttft_ms": (time.perf_counter() - started) * 1e3, "cached_tokens": out.num_cached_tokens or 0}
        return rec | {f"{hook}_ms": (t.seconds - before[hook]) * 1e3 for hook, t in self.timers.items()}

    def prompt(self, rep: int) -> Any:
        """The repetition's prompt, computed cold (KVLens stores it) the first time it is asked for."""
        if rep not in self.prompts:
            from vllm.inputs import TokensPrompt

            ids = [self.rng.randrange(100, self.vocab) for _ in range(self.args.tokens)]
            self.prompts = {rep: TokensPrompt(prompt_token_ids=ids)}
            self.ttft(self.prompts[rep])
            self.connector._worker.flush()
        return self.prompts[rep]

    def warm_up(self, side: Side) -> None:
        self.measure(side, Case("warm-up"), -1 - ["floor", "hit"].index(side.name))

    def measure(self, side: Side, case: Case, rep: int) -> dict[str, float]:
        prompt = self.prompt(rep)  # in vLLM's prefix cache now: after the cold run or the other's hit
        if side.name == "hit":
            self.llm.reset_prefix_cache()
            return self.ttft(prompt)
        beside = copy_beside(self.args.floor_beside_copy_mb)
        rec = self.ttft(prompt)
        if beside is not None:
            beside.join()
        return rec

    def workload(self) -> dict[str, Any]:
        return {"model": self.model, "prompt_tokens": self.args.tokens}


if __name__ == "__main__":
    sys.exit(main(HitProfile))
