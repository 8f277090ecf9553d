"""A ``vllm serve`` killed with SIGKILL (API server, engine core and workers at once) right after
a burst of requests, while disk writes may still be queued, then started again on the same
``local_disk``: what was stored before the kill is served from disk with the cold outputs, and
whatever the kill left half-written is never read (no load fails, outputs identical)."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from connector.tiers.disk import chunk_files

from ..telemetry.serve import (
    VllmServer,
    base_env,
    kv_transfer_config,
    prompt_tokens,
    sample,
    sum_samples,
    wait_until,
)

pytestmark = pytest.mark.integration

ARGS = ("--dtype", "float32")  # greedy outputs compared bit for bit
STORED = [prompt_tokens(700, 400 + i) for i in range(3)]  # 2 chunks + a 128-token block: 640
BURST = [prompt_tokens(900, 500 + i) for i in range(8)]


def serve(tiny_model: str, disk: Path, log: Path) -> VllmServer:
    kv = kv_transfer_config(chunk_size=256, local_cpu=False, local_disk=str(disk), max_local_disk_size=0.5)
    srv = VllmServer(tiny_model, kv, log, base_env(), ARGS)
    srv.wait_ready()
    return srv


def text(response) -> str:
    return response["choices"][0]["text"]


def loaded(response) -> dict:
    return response["kv_transfer_params"]["kvlens"]["loaded_tokens"]


def burst(srv: VllmServer) -> dict[int, str]:
    """The burst's prompts at once; returns the outputs of those that completed."""
    done: dict[int, str] = {}

    def one(i: int) -> None:
        try:
            done[i] = text(srv.complete(BURST[i], max_tokens=8))
        except Exception:  # the server may be killed under it
            pass

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(BURST))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return done


@pytest.fixture(scope="module")
def restarted(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("warm")
    disk = tmp / "kv"
    first = serve(tiny_model, disk, tmp / "first.log")
    try:
        cold = [text(first.complete(p, max_tokens=8)) for p in STORED]
        wait_until(lambda: sample(first.samples(), "vllm:kvlens_pending_writes") == 0, what="writes landed")
        burst_cold = burst(first)
        os.killpg(first.proc.pid, signal.SIGKILL)  # no shutdown: queued writes die with it
        first.proc.wait(timeout=30)
    finally:
        first.stop()
    # What a kill mid-write leaves: a temp file with half a chunk (never to be read).
    some = Path(chunk_files(str(disk))[0])
    half = some.read_bytes()
    (some.parent / ".tmp-killed-mid-write").write_bytes(half[: len(half) // 2])
    files_before = {f for _, _, names in os.walk(disk) for f in names}
    second = serve(tiny_model, disk, tmp / "second.log")
    try:
        warm = [second.complete(p, max_tokens=8) for p in STORED]
        burst_warm = {i: second.complete(BURST[i], max_tokens=8) for i in burst_cold}
        yield {
            "cold": cold,
            "warm": warm,
            "burst_cold": burst_cold,
            "burst_warm": burst_warm,
            "samples": second.samples(),
            "files_before": files_before,
        }
    finally:
        second.stop()


def test_prefixes_stored_before_the_kill_are_served_from_disk(restarted):
    for resp in restarted["warm"]:
        assert loaded(resp) == {"disk": 640}


def test_outputs_after_the_restart_are_the_cold_outputs(restarted):
    assert [text(r) for r in restarted["warm"]] == restarted["cold"]
    assert restarted["burst_cold"], "some of the burst completed before the kill"
    for i, resp in restarted["burst_warm"].items():
        assert text(resp) == restarted["burst_cold"][i]


def test_what_the_kill_left_half_written_is_never_read(restarted):
    s = restarted["samples"]
    assert ".tmp-killed-mid-write" in restarted["files_before"]
    assert sum_samples(s, "vllm:kvlens_failed_blocks_total") == 0
    assert sum_samples(s, "vllm:kvlens_failed_load_requests_total") == 0
    assert sum_samples(s, "vllm:kvlens_failed_chunks_total", operation="load") == 0
