"""Real ``vllm serve`` (CPU) restarted on a disk tier an earlier run filled, at default settings:
every request hits, so no step is a cold prefill. The engine still measures what a prefill
token costs (checked against the wall clock), and the bytes it reads from disk match vLLM's own
count of disk-cached tokens and the chunk files."""

from __future__ import annotations

import json
import struct
import time
from types import SimpleNamespace

import pytest

from .serve import VllmServer, base_env, kv_transfer_config, prompt_tokens, sample, sum_samples, wait_until

pytestmark = pytest.mark.integration

CHUNK = 256
MAGIC, LEN = b"KVLENS1\n", struct.Struct("<I")
PER_TOKEN = "vllm:kvlens_prefill_seconds_per_token"


def serve(tiny_model, tmp, name) -> VllmServer:
    kv = kv_transfer_config(local_disk=str(tmp / "kv"), max_local_disk_size=1)
    srv = VllmServer(
        tiny_model, kv, tmp / f"{name}.log", base_env(KVLENS_EVENT_LOG=str(tmp / "events.jsonl"))
    )
    srv.wait_ready()
    return srv


@pytest.fixture(scope="module")
def warm(tiny_model, tmp_path_factory):
    """Prefixes of 2 or 3 whole chunks stored by a first server, then a second one on the same disk."""
    tmp = tmp_path_factory.mktemp("warm-restart")
    prefixes = [prompt_tokens(CHUNK * (2 + i % 2), 700 + i) for i in range(14)]
    first = serve(tiny_model, tmp, "first")
    try:
        for p in prefixes:
            first.complete(p, max_tokens=1)
        wait_until(lambda: sample(first.samples(), "vllm:kvlens_pending_writes") == 0, what="writes landed")
    finally:
        first.stop()
    second = serve(tiny_model, tmp, "second")
    try:
        yield SimpleNamespace(server=second, prefixes=prefixes, disk=tmp / "kv")
    finally:
        second.stop()


def whole_chunk_bytes(disk) -> int:
    """The payload a whole chunk's record on disk declares (the largest record's)."""
    sizes = []
    for path in disk.rglob("*.kvlens"):  # records lie in subdirectories
        record = path.read_bytes()
        (hlen,) = LEN.unpack(record[len(MAGIC) : len(MAGIC) + LEN.size])
        start = len(MAGIC) + LEN.size
        sizes.append(json.loads(record[start : start + hlen])["nbytes"])
    return max(sizes)


def plain_read_speed(disk) -> float:
    """Bytes per second reading every chunk file whole, best of three passes (page cache warm)."""
    files = list(disk.rglob("*.kvlens"))
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        nbytes = sum(len(f.read_bytes()) for f in files)
        best = min(best, time.perf_counter() - started)
    return nbytes / best


def cold_seconds_per_token(srv) -> float:
    """The wall clock's marginal cost of a prefill token: the latency difference between new
    prompts of two lengths (client overhead cancels), best of three each."""
    best = {}
    for n in (400, 1600):
        times = []
        for k in range(3):
            started = time.monotonic()
            srv.complete(prompt_tokens(n, 5000 + 10 * n + k), max_tokens=1)
            times.append(time.monotonic() - started)
        best[n] = min(times)
    return (best[1600] - best[400]) / 1200


def test_every_request_of_a_warm_restart_hits_and_the_prefill_cost_is_still_measured(warm):
    srv = warm.server
    started = time.monotonic()
    loaded = 0
    # What each hit's loaded tokens were worth at the cost per token the engine had measured
    # before and after it (its /metrics): the bounds of the price it put on them. The cost moves
    # with the machine's load, so the final estimate alone does not price every hit.
    worth_low = worth_high = 0.0
    cost = sample(srv.samples(), PER_TOKEN) or 0.0
    for i, prefix in enumerate(warm.prefixes):  # each hits its prefix and computes a new tail
        tail = prompt_tokens(100 + (113 * i) % 1300, 900 + i)
        out = srv.complete(prefix + tail, max_tokens=4)["kv_transfer_params"]["kvlens"]
        assert out["loaded_tokens"] == {"disk": len(prefix)}
        loaded += len(prefix)
        cost_after = sample(srv.samples(), PER_TOKEN) or 0.0
        if cost > 0:  # priced: the cost was known before this hit
            worth_low += len(prefix) * min(cost, cost_after)
        worth_high += len(prefix) * max(cost, cost_after)
        cost = cost_after
    wall = time.monotonic() - started

    def measured():  # a cost, not the 0 a series existing from start-up would show
        s = srv.samples()
        return s if (sample(s, PER_TOKEN) or 0) > 0 else None

    s = wait_until(measured, what="a prefill cost measured from steps that all loaded")
    estimate = sample(s, PER_TOKEN)
    saved = sum_samples(s, "vllm:kvlens_prefill_seconds_saved_total", tier="disk")
    assert worth_low > 0, "no hit came after the cost was known"
    assert worth_low / 1.5 <= saved <= worth_high * 1.5, (worth_low, saved, worth_high)  # priced once known
    # against the wall clock: new prompts' latency grows by about the estimate per token
    measured_cost = cold_seconds_per_token(srv)
    assert measured_cost / 3 < estimate < measured_cost * 3, (estimate, measured_cost)

    # the bytes read from disk and copied into vLLM: vLLM's own disk-cached tokens, in records
    per_token = whole_chunk_bytes(warm.disk) / CHUNK
    disk_tokens = sum_samples(s, "vllm:prompt_tokens_cached_by_source_total", source="disk")
    assert disk_tokens == loaded
    for stage in ("read", "copy"):
        assert (
            sum_samples(s, "vllm:kvlens_transfer_bytes_total", stage=stage, tier="disk") == loaded * per_token
        )
        assert 0 < sum_samples(s, "vllm:kvlens_transfer_seconds_total", stage=stage, tier="disk") < wall

    # the read speed it reports is no faster than reading the same files plainly (and no crawl)
    read_speed = (
        loaded * per_token / sum_samples(s, "vllm:kvlens_transfer_seconds_total", stage="read", tier="disk")
    )
    plain = plain_read_speed(warm.disk)
    assert plain / 50 < read_speed < 2 * plain, (read_speed, plain)
    print(f"prefill s/token: estimate {estimate:.3g}, wall clock {measured_cost:.3g}")
    print(f"disk read: {read_speed / 1e6:.0f} MB/s; plain reads of the files {plain / 1e6:.0f} MB/s")
