"""What the throughput workloads share (``prefix_repetition.py``, ``multi_round_chat.py``,
``long_doc_qa.py``): each repetition of a mode is a whole run of many requests, on a data set of
its own (the same for every mode), started after vLLM's prefix cache is flushed, with a vLLM KV
memory too small for the working set in every mode but the ceiling.

Each run also records where vLLM got the prompt tokens (computed, its own prefix cache, the
connector): the evidence that the working set did not fit. Records use the key names of ``vllm
bench serve``'s result file (``total_token_throughput``, ``p99_ttft_ms``, ...).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from . import report
from .client import REQUEST_TIMEOUT_S, Client, metric_sum, stream
from .models import kv_bytes_per_token
from .report import Figure, Record
from .served import LiveMode, ServedBenchmark, ServerShape

VLLM_CPU_BLOCK = 128  # tokens per KV block in vLLM on CPU
CEILING_GIB = 1  # VLLM_CPU_KVCACHE_SPACE of every mode; only the ceiling is not capped in blocks
SOURCES_METRIC = "vllm:prompt_tokens_by_source_total"
SOURCES = {"tokens_computed": "local_compute", "tokens_vllm_hit": "local_cache_hit"}
SOURCES["tokens_connector"] = "external_kv_transfer"
PREEMPTIONS_METRIC = "vllm:num_preemptions_total"

OUTPUT_TPUT = Figure("output_throughput", "output tok/s", "{:.1f}", plot=False)
TOTAL_TPUT = Figure("total_token_throughput", "total tok/s", "{:.1f}", ratio=True)
REQUEST_TPUT = Figure("request_throughput", "req/s", plot=False)
SOURCES_PANEL = "where prompt tokens came from, per repetition"
COUNTS = (
    Figure("failed", "failed", "{:.0f}", plot=False),
    *(Figure(k, f"tokens {k.split('_', 1)[1]}", "{:.0f}", panel=SOURCES_PANEL) for k in SOURCES),
)


def ttft(p: int, ratio: bool = True) -> Figure:
    return Figure(
        f"p{p}_ttft_ms", f"TTFT p{p} ms", "{:.0f}", ratio=ratio, log=True, panel="time to first token"
    )


def blocks(tokens: int) -> int:
    return -(-tokens // VLLM_CPU_BLOCK)


@dataclass(frozen=True, slots=True)
class Turn:
    """One request, as measured (``ok`` False: it failed; ``error`` says how)."""

    ok: bool
    ttft: float
    latency: float
    prompt_tokens: int
    output_tokens: int
    error: str = ""
    cached_tokens: int = 0  # vLLM's prefix hit plus the connector's, as the response reports them
    answer: tuple[int, ...] = ()  # the generated token ids


async def ask(session: aiohttp.ClientSession, url: str, prompt: list[int], answer_len: int) -> Turn:
    """One streamed request; a failure is a Turn, not an exception."""
    t0 = time.perf_counter()
    try:
        done = await stream(session, url, prompt, answer_len, timeout=REQUEST_TIMEOUT_S)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        late = time.perf_counter() - t0
        return Turn(False, math.nan, late, len(prompt), 0, report.first_line(repr(e), 200))
    return Turn(
        True,
        done.ttft,
        done.latency,
        done.prompt_tokens,
        len(done.token_ids),
        "",
        done.cached_tokens,
        done.token_ids,
    )


def record(turns: Sequence[Turn], wall: float) -> Record:
    """Figures of requests that took ``wall`` seconds, under the names vllm bench serve gives them."""
    ok = [t for t in turns if t.ok]
    inp = sum(t.prompt_tokens for t in ok)
    out = sum(t.output_tokens for t in ok)
    rec: Record = {
        "duration": wall,
        "completed": len(ok),
        "failed": len(turns) - len(ok),
        "total_input_tokens": inp,
        "total_output_tokens": out,
        "request_throughput": len(ok) / wall,
        "output_throughput": out / wall,
        "total_token_throughput": (inp + out) / wall,
        "mean_ttft_ms": 1000 * sum(t.ttft for t in ok) / len(ok) if ok else math.nan,
        "errors": sorted({t.error for t in turns if not t.ok}),  # the raw JSON keeps them
    }
    for p in (50, 90, 99):
        rec[f"p{p}_ttft_ms"] = 1000 * report.percentile([t.ttft for t in ok], p)
        rec[f"p{p}_e2el_ms"] = 1000 * report.percentile([t.latency for t in ok], p)
    return rec


class ThroughputBenchmark(ServedBenchmark):
    """Define ``sizes`` (the servers' max_model_len, default KV blocks, one repetition's working
    set in tokens) and ``run_once`` (one repetition's requests against one server)."""

    kvlens_tiers = "cpu"
    baselines = ("none",)

    def sizes(self) -> tuple[int, int, int]:
        raise NotImplementedError

    def run_once(self, lm: LiveMode, rep: int) -> Record:
        raise NotImplementedError

    def server_shape(self) -> ServerShape:
        """``kv_blocks`` of vLLM KV memory in every mode but the ceiling, which gets ``CEILING_GIB``;
        notes how one repetition's working set compares with both."""
        max_model_len, default_blocks, working_set = self.sizes()
        kv_blocks = self.args.kv_blocks or default_blocks
        if kv_blocks < blocks(max_model_len):
            raise SystemExit(
                f"--kv-blocks {kv_blocks} cannot hold one request ({blocks(max_model_len)} blocks)"
            )
        per_token = kv_bytes_per_token(self.model)
        cap = kv_blocks * VLLM_CPU_BLOCK
        self.note(
            f"vLLM KV memory in every mode but the ceiling: {kv_blocks} blocks = {cap} tokens "
            f"({cap * per_token / 2**20:.0f} MiB); one repetition's working set: {working_set} tokens "
            f"({working_set / cap:.1f}x)"
        )
        if any(m.ceiling for m in self.modes) and working_set * per_token > CEILING_GIB * 2**30:
            self.note(f"the ceiling's {CEILING_GIB} GiB of KV memory does not hold the working set either")
        self.kv_sizes = {"kv_blocks": kv_blocks, "kv_tokens": cap, "working_set_tokens": working_set}
        return ServerShape(
            max_model_len,
            kv_blocks,
            CEILING_GIB,
            working_set_gb=self.args.repeats * working_set * per_token / 1e9,  # a connector keeps them all
        )

    def measure(self, lm: LiveMode, case: Any, rep: int) -> Record:
        lm.client.reset_prefix_cache()
        before = _counters(lm.client)
        rec = self.run_once(lm, rep)
        after = _counters(lm.client)
        if rec.get("errors"):
            print(f"   {lm.name}: {len(rec['errors'])} kind(s) of error, e.g. {rec['errors'][0]}", flush=True)
        return {**rec, **{k: after[k] - before[k] for k in before}}

    def workload(self) -> dict[str, Any]:
        return dict(getattr(self, "kv_sizes", {}))


def _counters(client: Client) -> dict[str, float]:
    """Prompt tokens by source and preemptions so far (NaN when the server cannot tell)."""
    try:
        text = client.metrics_text()
    except OSError:
        return {k: math.nan for k in [*SOURCES, "preemptions"]}
    out = {k: metric_sum(text, SOURCES_METRIC, source=src) for k, src in SOURCES.items()}
    out["preemptions"] = metric_sum(text, PREEMPTIONS_METRIC)
    return out
