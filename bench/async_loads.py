"""Slow tiers and the running batch: inter-token latency of decoding requests while a burst of
requests loads its prompts from the disk or the remote tier, with loads in the step and
asynchronous loads (``enable_async_loading``) side by side.

    python bench/async_loads.py [--quick] [--modes kvlens-disk,kvlens-disk-async,...]

Every repetition, in every mode: the burst's prompts are stored first (sent once, then vLLM's
own prefix cache is flushed, so they come back from the tier); --decoders requests then decode
--decode-tokens tokens each, streamed, once alone and once while --burst requests whose prompts
the tier holds arrive together once every decoder has its first tokens. Figures: the decoders'
inter-token latency (p50, p99, max over every gap after their first token) without and with the
burst, their ratio (p99 with / without: the goal is at most 1.2), and the burst's TTFT. With a
remote mode and no --kvlens-remote-url, a private redis-server is started.
Ratios of the asynchronous modes are taken to their in-step twin (``kvlens-disk``,
``kvlens-remote``) per repetition.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib import report  # noqa: E402
from bench.lib import workload as wl  # noqa: E402
from bench.lib.client import _body  # noqa: E402
from bench.lib.runner import Figure, Option, Target, main  # noqa: E402
from bench.lib.served import LiveMode  # noqa: E402


async def decode_times(
    session: aiohttp.ClientSession, url: str, prompt: list[int], n: int, times: list[float]
) -> None:
    """Append the arrival time of each streamed token event (monotonic seconds) to ``times``."""
    body = {**_body(prompt, n, None), "stream": True}
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            chunk = json.loads(line[5:])
            if any(c.get("text") or c.get("token_ids") for c in chunk.get("choices") or ()):
                times.append(time.monotonic())


async def ttft(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> float:
    t0 = time.monotonic()
    async with session.post(url + "/v1/completions", json=_body(prompt, 1, None)) as resp:
        resp.raise_for_status()
        await resp.read()
    return time.monotonic() - t0


async def phase(url: str, decoders: list[list[int]], n: int, burst: list[list[int]]) -> dict:
    """Decoders stream ``n`` tokens each; once every one is decoding, the burst arrives. The
    decoders' gaps between tokens after their first (their prefill is not decode latency)."""
    streams: list[list[float]] = [[] for _ in decoders]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
        tasks = [
            asyncio.create_task(decode_times(session, url, p, n, t))
            for p, t in zip(decoders, streams, strict=True)
        ]
        while not all(len(t) >= 2 for t in streams) and not all(task.done() for task in tasks):
            await asyncio.sleep(0.002)
        ttfts = await asyncio.gather(*(ttft(session, url, p) for p in burst))
        await asyncio.gather(*tasks)
    gaps = [(b - a) * 1000 for times in streams for a, b in zip(times[1:], times[2:], strict=False)]
    return {"gaps": gaps, "ttfts": list(ttfts)}


class AsyncLoads(wl.ThroughputBenchmark):
    name = "async_loads"
    default_modes = "kvlens-disk,kvlens-disk-async,kvlens-remote,kvlens-remote-async"
    quick_modes = "kvlens-disk,kvlens-disk-async"
    baselines = ("kvlens-disk", "kvlens-remote")
    seed = 31
    options = {
        "decoders": Option(4, 2, "requests decoding during the burst"),
        "decode_tokens": Option(256, 160, "tokens each decoder generates (outlasting the burst)"),
        "decoder_prompt": Option(256, 128, "tokens of each decoder's prompt"),
        "burst": Option(6, 3, "requests in the burst, each a stored prompt"),
        "burst_prompt": Option(2944, 1280, "tokens of each burst prompt (whole blocks: all from the tier)"),
        "kv_blocks": Option(
            None, help="vLLM KV blocks (default: the burst and the decoders at once)", type=int
        ),
    }
    figures = (
        Figure("itl_p50_ms_alone", "ITL p50 alone (ms)", "{:.1f}", plot=False),
        Figure("itl_p99_ms_alone", "ITL p99 alone (ms)", "{:.1f}", plot=False),
        Figure("itl_p50_ms", "ITL p50 with burst (ms)", "{:.1f}", plot=False),
        Figure("itl_p99_ms", "ITL p99 with burst (ms)", "{:.1f}", ratio=True),
        Figure("itl_max_ms", "ITL max with burst (ms)", "{:.1f}", plot=False),
        Figure("itl_p99_x_alone", "ITL p99 burst / alone", "{:.2f}"),
        Figure("burst_ttft_p50_ms", "burst TTFT p50 (ms)", "{:.1f}", ratio=True),
        Figure("burst_loaded_tokens", "burst tokens from the tier", "{:.0f}", plot=False),
    )
    legend = ("Lower is better; the goal is ITL p99 during the burst at most 1.2x alone.",)
    targets = (
        Target(
            "disk, asynchronous: ITL p99 burst <= 1.2 x alone",
            "itl_p99_x_alone",
            1.2,
            mode_prefix="kvlens-disk-async",
        ),
        Target(
            "remote, asynchronous: ITL p99 burst <= 1.2 x alone",
            "itl_p99_x_alone",
            1.2,
            mode_prefix="kvlens-remote-async",
        ),
    )

    @property
    def title(self) -> str:
        a = self.args
        return (
            f"decoding beside a burst of tier hits: {a.decoders} decoders x {a.decode_tokens} tokens, "
            f"{a.burst} x {a.burst_prompt}-token hits"
        )

    def sizes(self) -> tuple[int, int, int]:
        a = self.args
        max_len = max(a.burst_prompt, a.decoder_prompt + a.decode_tokens) + 16
        kv_blocks = wl.blocks(max_len) * (a.burst + a.decoders) + 1
        return max_len, kv_blocks, a.burst * a.burst_prompt

    @contextlib.contextmanager
    def setup(self) -> Iterator[None]:
        with super().setup():
            remote = any("remote" in m.name for m in self.modes)
            if not remote or self.settings.kvlens_remote_url:
                yield
                return
            from tests.redis.servers import RedisServer

            redis = RedisServer(self.work_dir / "redis").start()
            self.settings = dataclasses.replace(self.settings, kvlens_remote_url=redis.url)
            try:
                yield
            finally:
                redis.kill()

    def prompts(self, rep: int) -> tuple[list[list[int]], list[list[int]]]:
        a = self.args
        rng = random.Random(self.seed * 1000 + rep)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(10, self.vocab - 1) for _ in range(n)]

        return [tokens(a.decoder_prompt) for _ in range(a.decoders)], [
            tokens(a.burst_prompt) for _ in range(a.burst)
        ]

    def run_once(self, lm: LiveMode, rep: int) -> dict[str, Any]:
        a, url = self.args, lm.server.url
        decoders, burst = self.prompts(rep)
        for p in burst:  # stored in the tier
            lm.client.complete(p, max_tokens=1)
        deadline = time.monotonic() + 60
        while lm.client.metric_sum("vllm:kvlens_pending_writes") > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        lm.client.reset_prefix_cache()
        alone = asyncio.run(phase(url, decoders, a.decode_tokens, []))
        lm.client.reset_prefix_cache()
        loaded_before = lm.client.metric_sum("vllm:kvlens_load_tokens_total")
        during = asyncio.run(phase(url, [d[::-1] for d in decoders], a.decode_tokens, burst))
        loaded = lm.client.metric_sum("vllm:kvlens_load_tokens_total") - loaded_before
        pct = report.percentile
        rec = {
            "itl_p50_ms_alone": pct(alone["gaps"], 50),
            "itl_p99_ms_alone": pct(alone["gaps"], 99),
            "itl_p50_ms": pct(during["gaps"], 50),
            "itl_p99_ms": pct(during["gaps"], 99),
            "itl_max_ms": max(during["gaps"], default=math.nan),
            "burst_ttft_p50_ms": 1000 * pct(during["ttfts"], 50),
            "burst_loaded_tokens": loaded,
        }
        rec["itl_p99_x_alone"] = rec["itl_p99_ms"] / rec["itl_p99_ms_alone"]
        return rec


if __name__ == "__main__":
    sys.exit(main(AsyncLoads))
