"""Slow tiers and the running batch: inter-token latency of decoding requests while a burst of
requests loads its prompts from the disk or the remote tier, with loads in the step and
asynchronous loads (``enable_async_loading``) side by side.

    python bench/async_loads.py [--quick] [--modes kvlens-disk,kvlens-disk-async,lmcache,lmcache-disk,...]

Every repetition, in every mode: the burst's prompts are stored first (sent once, then vLLM's
own prefix cache is flushed, so they come back from the tier); --decoders requests then decode
--decode-tokens tokens each, streamed, once alone and once while --burst requests whose prompts
the tier holds arrive together once every decoder has its first tokens. Figures: the decoders'
inter-token latency (p50, p99, max over every gap after their first token) without and with the
burst, their ratio (p99 with / without: the goal is at most 1.2), and the burst's TTFT. With a
remote mode and no --kvlens-remote-url, a private redis-server is started.
Ratios of the asynchronous modes are taken to their in-step twin (``kvlens-disk``,
``kvlens-remote``) per repetition. ``none`` is the floor: no connector, and the burst is vLLM's
own prefix-cache hit (nothing to load; what is left is the burst's own compute in the batch).

LMCache as a peer (bench/lib/modes.py): ``lmcache`` (its multiprocess mode; the burst comes from
its server's memory) and ``lmcache-disk`` (the same with a disk L2 and the ``skip_l1`` store
policy: the burst is prefetched from disk at lookup). Both load asynchronously, the only way
vLLM's ``LMCacheMPConnector`` loads; there is no in-step LMCache twin here, since the in-process
``LMCacheConnectorV1`` (in-step loads; ``enable_async_loading`` makes only its lookups and
prefetches asynchronous) has no CPU path in LMCache 0.5.6. Their ratios are to the KVLens modes
in the same run.
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
from bench.lib.client import Client, _body  # noqa: E402
from bench.lib.models import kv_bytes_per_token  # noqa: E402
from bench.lib.runner import Figure, Option, Target, main  # noqa: E402
from bench.lib.served import LiveMode  # noqa: E402

STORE_WAIT_S = 60.0
# Prompt tokens a connector supplied, as vLLM counts them (any connector; KVLens has its own).
CONNECTOR_TOKENS = ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"})
LMCACHE_L2_BYTES = "lmcache_mp_l2_usage_bytes"  # LMCache server: bytes its L2 adapters hold


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

    def loaded_tokens(self, lm: LiveMode) -> float:
        """Prompt tokens loaded so far: KVLens's own counter, vLLM's for the other connectors."""
        if lm.mode.connector == "kvlens":
            return lm.client.metric_sum("vllm:kvlens_load_tokens_total")
        name, labels = CONNECTOR_TOKENS
        return lm.client.metric_sum(name, **labels)

    def burst_l2_bytes(self) -> int:
        """What the burst's whole LMCache chunks take in bf16 (a lower bound of their L2 bytes)."""
        a, chunk = self.args, self.settings.lmcache_chunk_size
        return a.burst * (a.burst_prompt // chunk * chunk) * kv_bytes_per_token(self.model)

    def wait_stored(self, lm: LiveMode, l2_before: float) -> None:
        """Until the burst is where its next lookup will find it: KVLens's queued writes done;
        with LMCache's disk L2, the burst's chunks written to it (``skip_l1`` then drops them
        from the server's memory)."""
        deadline = time.monotonic() + STORE_WAIT_S
        while lm.client.metric_sum("vllm:kvlens_pending_writes") > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        if lm.sidecar is None or lm.mode.tier is None:
            return
        server = Client(f"http://127.0.0.1:{lm.sidecar.http_port}")
        want = l2_before + self.burst_l2_bytes()
        while (have := server.metric_sum(LMCACHE_L2_BYTES)) < want:
            if time.monotonic() > deadline:
                got = f"{have - l2_before:.0f} of {want - l2_before} bytes"
                print(f"   {lm.name}: the burst is not all in LMCache's L2 ({got})", flush=True)
                return
            time.sleep(0.2)
        time.sleep(0.5)  # the L1 deletions follow the L2 stores

    def run_once(self, lm: LiveMode, rep: int) -> dict[str, Any]:
        a, url = self.args, lm.server.url
        decoders, burst = self.prompts(rep)
        l2_before = (
            Client(f"http://127.0.0.1:{lm.sidecar.http_port}").metric_sum(LMCACHE_L2_BYTES)
            if lm.sidecar is not None
            else 0.0
        )
        for p in burst:  # stored in the tier
            lm.client.complete(p, max_tokens=1)
        self.wait_stored(lm, l2_before)
        floor = lm.mode.connector is None  # no connector: the burst is vLLM's own prefix hit
        if not floor:
            lm.client.reset_prefix_cache()
        alone = asyncio.run(phase(url, decoders, a.decode_tokens, []))
        if not floor:
            lm.client.reset_prefix_cache()
        loaded_before = self.loaded_tokens(lm)
        during = asyncio.run(phase(url, [d[::-1] for d in decoders], a.decode_tokens, burst))
        loaded = self.loaded_tokens(lm) - loaded_before
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
