"""Real ``vllm serve`` (CPU) with KVLens's CPU, disk and remote tiers at default settings and a
real redis-server that runs out of memory midway: each number KVLens reports for stores, bytes
moved and the what-if curve, against a count taken outside KVLens (the keys and records Redis
holds and its own command and error statistics, the chunk files on disk, vLLM's own counters,
the wall clock)."""

from __future__ import annotations

import itertools
import json
import struct
import threading
import time
from types import SimpleNamespace

import pytest

from connector.engine.outcomes import REMOTE_ERROR_KINDS, FailureReason, MissReason, SaveSkipReason
from connector.scheduler.shared_marks import MARK_KEY
from connector.scheduler.tenant_id_key import KEY_NAME as TENANT_ID_KEY
from connector.tiers.store_records import NAMESPACE_KEY
from tests.redis.servers import REDIS_SERVER, RedisServer
from tests.redis.test_serve_remote import LOOKUP_BUDGET

from .serve import VllmServer, base_env, kv_transfer_config, prompt_tokens, sample, sum_samples, wait_until

pytestmark = pytest.mark.integration

if not REDIS_SERVER:
    pytest.skip("redis-server is not installed (bash scripts/setup.sh)", allow_module_level=True)

PREFIX = "numbers"
CHUNK, BLOCK = 256, 128  # the default chunk size; vLLM's block size on CPU
TIERS = ("cpu", "disk", "remote")
STAGES = ("gather", "write", "read", "copy")
MAGIC, LEN = b"KVLENS1\n", struct.Struct("<I")


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tier-counts")
    redis = RedisServer(tmp / "redis").start()
    kv = kv_transfer_config(
        local_disk=str(tmp / "kv"),
        max_local_disk_size=1,
        remote_url=redis.url,
        extra_config={"remote_key_prefix": PREFIX, **LOOKUP_BUDGET},
    )
    server = VllmServer(
        tiny_model, kv, tmp / "serve.log", base_env(KVLENS_EVENT_LOG=str(tmp / "events.jsonl"))
    )
    try:
        server.wait_ready()
        yield SimpleNamespace(
            server=server, redis=redis.client(), disk=tmp / "kv", started=time.monotonic(), prompts=[]
        )
    finally:
        server.stop()
        redis.kill()


def payload_nbytes(record: bytes) -> int:
    """The payload size a chunk record declares, checked against the record's own length."""
    assert record[: len(MAGIC)] == MAGIC
    (hlen,) = LEN.unpack(record[len(MAGIC) : len(MAGIC) + LEN.size])
    start = len(MAGIC) + LEN.size
    nbytes = json.loads(record[start : start + hlen])["nbytes"]
    assert len(record) == start + hlen + nbytes
    return nbytes


def bytes_per_token(records: list[bytes]) -> float:
    """A whole chunk's payload over its tokens (tails hold fewer tokens: whole blocks of them)."""
    return max(payload_nbytes(r) for r in records) / CHUNK


def disk_records(stack) -> list[bytes]:
    return [f.read_bytes() for f in stack.disk.rglob("*.kvlens")]  # records lie in subdirectories


def redis_records(stack) -> list[bytes]:
    # chunk records only: not the namespace descriptors, the first-chunk marks nor the tenant-id key
    others = tuple(f"{PREFIX}:{kind}".encode() for kind in (NAMESPACE_KEY, MARK_KEY))
    tenant_key = f"{PREFIX}:{TENANT_ID_KEY}".encode()
    return [
        stack.redis.get(k)
        for k in stack.redis.keys(f"{PREFIX}:*")
        if not k.startswith(others) and k != tenant_key
    ]


def oom_rejections(stack) -> int:
    return stack.redis.info("errorstats").get("errorstat_OOM", {}).get("count", 0)


def drained(srv) -> None:
    """Background writes have landed (the gauge and the counts leave the engine in one step)."""

    wait_until(lambda: sample(srv.samples(), "vllm:kvlens_pending_writes") == 0, timeout=60, what="writes")


def send(stack, prompt, **kw):
    stack.prompts.append(prompt)
    return stack.server.complete(prompt, **kw)


def test_closed_label_sets_are_on_metrics_at_zero_before_any_traffic(stack):
    s = stack.server.samples()
    for reason in FailureReason:
        assert sample(s, "vllm:kvlens_failed_blocks_total", reason=reason.value) == 0
        for op, tier in itertools.product(("load", "store"), TIERS):
            assert (
                sample(s, "vllm:kvlens_failed_chunks_total", operation=op, tier=tier, reason=reason.value)
                == 0
            )
    for reason in MissReason:
        assert sample(s, "vllm:kvlens_miss_requests_total", reason=reason.value) == 0
    for reason in SaveSkipReason:
        assert sample(s, "vllm:kvlens_save_skipped_requests_total", reason=reason.value) == 0
    for op, kind in itertools.product(("exists", "get", "put", "delete"), REMOTE_ERROR_KINDS):
        assert sample(s, "vllm:kvlens_remote_errors_total", operation=op, kind=kind) == 0
    for stage, tier in itertools.product(STAGES, TIERS):
        assert sample(s, "vllm:kvlens_transfer_bytes_total", stage=stage, tier=tier) == 0
    names = {name for name, _ in s}
    # unknown until measured: no series rather than a 0 that alerts and panels would believe
    assert "vllm:kvlens_prefill_seconds_per_token" not in names
    assert not any(n.startswith(("vllm:kvlens_prefill_seconds_saved", "vllm:kvlens_whatif")) for n in names)


def test_stores_count_what_each_tier_holds_when_redis_runs_out_of_memory(stack):
    srv, redis = stack.server, stack.redis
    send(stack, prompt_tokens(700, 901), max_tokens=4)  # two whole chunks
    drained(srv)
    record = max(redis_records(stack), key=len)
    redis.config_set("maxmemory-policy", "noeviction")
    redis.config_set("maxmemory", str(redis.info("memory")["used_memory"] + int(2.5 * len(record))))
    rejected_before = oom_rejections(stack)
    try:  # a burst: new prompts beside a long decode; Redis refuses writes once full
        jobs = [(prompt_tokens(300, 902), 48)] + [(prompt_tokens(700 + 40 * i, 910 + i), 4) for i in range(5)]
        threads = [threading.Thread(target=send, args=(stack, p), kwargs={"max_tokens": n}) for p, n in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        drained(srv)
    finally:
        redis.config_set("maxmemory", "0")
    s = srv.samples()
    on_disk, in_redis = disk_records(stack), redis_records(stack)
    rejected = oom_rejections(stack) - rejected_before
    assert rejected > 0 and len(in_redis) < len(on_disk)  # the workload did what it is for

    def counted(name, **labels):
        return sum_samples(s, f"vllm:kvlens_{name}_total", **labels)

    assert counted("store_chunks", tier="remote") == len(in_redis)
    assert counted("store_bytes", tier="remote") == sum(payload_nbytes(r) for r in in_redis)
    assert counted("store_chunks", tier="disk") == len(on_disk) == counted("store_chunks", tier="cpu")
    assert counted("store_bytes", tier="disk") == sum(payload_nbytes(r) for r in on_disk)
    assert counted("store_tokens", tier="disk") == sum(payload_nbytes(r) for r in on_disk) / bytes_per_token(
        on_disk
    )
    # every chunk went to all three tiers: what Redis lacks was refused (OOM) or skipped after
    assert counted("failed_chunks", operation="store", tier="remote", reason="io_error") == rejected
    assert counted("failed_chunks", operation="store", tier="remote") == len(on_disk) - len(in_redis)


def test_bytes_moved_per_stage_match_the_records_and_vllms_own_counts(stack):
    srv, redis = stack.server, stack.redis
    s = srv.samples()
    on_disk, in_redis = disk_records(stack), redis_records(stack)
    per_token = bytes_per_token(on_disk)

    def moved(what, stage, tier, samples=None):
        return sum_samples(samples or s, f"vllm:kvlens_transfer_{what}_total", stage=stage, tier=tier)

    assert moved("bytes", "write", "disk") == sum(payload_nbytes(r) for r in on_disk)
    assert moved("bytes", "write", "remote") == sum(payload_nbytes(r) for r in in_redis)
    every_chunk = sum(payload_nbytes(r) for r in on_disk)  # the disk holds every chunk stored
    assert moved("bytes", "gather", "cpu") == moved("bytes", "gather", "disk") == every_chunk
    assert moved("bytes", "write", "cpu") == 0  # the CPU tier keeps the gathered buffer
    # time: within the wall clock, and no less than Redis itself spent executing the SETs
    wall = time.monotonic() - stack.started
    for stage, tier in (("gather", "cpu"), ("write", "disk"), ("write", "remote")):
        assert 0 < moved("seconds", stage, tier) < wall, (stage, tier)
    assert moved("seconds", "write", "remote") >= redis.info("commandstats")["cmdstat_set"]["usec"] / 1e6
    # a load from the CPU tier: bytes copied in are vLLM's own count of host-cached tokens
    before = srv.samples()
    srv.reset_prefix_cache()
    started = time.monotonic()
    out = send(stack, stack.prompts[0], max_tokens=4)
    took = time.monotonic() - started
    loaded = out["kv_transfer_params"]["kvlens"]["loaded_tokens"]
    assert list(loaded) == ["cpu"] and loaded["cpu"] >= 2 * CHUNK

    def grew():
        after = srv.samples()
        host = sum_samples(after, "vllm:prompt_tokens_cached_by_source_total", source="host") - sum_samples(
            before, "vllm:prompt_tokens_cached_by_source_total", source="host"
        )
        copied = moved("bytes", "copy", "cpu", after) - moved("bytes", "copy", "cpu", before)
        return (
            host,
            copied,
            moved("seconds", "copy", "cpu", after) - moved("seconds", "copy", "cpu", before),
        )

    host, copied, seconds = wait_until(lambda: (g := grew())[1] and g, what="the load's copies counted")
    assert host == loaded["cpu"] and copied == host * per_token
    assert 0 < seconds < took


def test_the_whatif_curve_is_complete_once_the_engine_idles_without_another_request(stack):
    srv = stack.server
    srv.reset_prefix_cache()
    send(stack, stack.prompts[1], max_tokens=1)  # a last burst: two quick requests, then nothing
    send(stack, prompt_tokens(600, 990), max_tokens=1)
    time.sleep(5)
    s = srv.samples()
    # Every tier holds everything at every factor here, so an exact LRU misses each chunk's first
    # reference and hits the others, weighted by bytes (tokens). Each request references its
    # whole chunks and its stored tail (the longest whole-block prefix of the unfull rest).
    counts: dict[tuple[int, ...], int] = {}
    for p in stack.prompts:
        whole, rest = divmod(len(p), CHUNK)
        ends = [(i + 1) * CHUNK for i in range(whole)]
        if rest >= BLOCK:
            ends.append(whole * CHUNK + rest // BLOCK * BLOCK)
        for end in ends:
            counts[tuple(p[:end])] = counts.get(tuple(p[:end]), 0) + 1

    def tokens(key):
        return len(key) - (len(key) - 1) // CHUNK * CHUNK

    referenced = sum(n * tokens(k) for k, n in counts.items())
    expected = sum((n - 1) * tokens(k) for k, n in counts.items()) / referenced
    for tier in ("cpu", "disk"):
        for factor in ("0.125", "1", "16"):
            got = sample(s, "vllm:kvlens_whatif_hit_ratio", tier=tier, budget_factor=factor)
            assert got == pytest.approx(expected, abs=1e-4), (tier, factor, got, expected)
