"""Real ``vllm serve`` (CPU) with KVLens's disk tier: disk hits attributed to disk, and a load
that fails (chunk files corrupted between store and load) is logged as an event, counted,
marked on the load span and in the response, while vLLM recomputes the same output."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from connector.tiers.disk import chunk_files as disk_chunk_files
from telemetry.events import read_events

from .serve import kv_transfer_config, prompt_tokens, sample, sum_samples, traceparent, wait_until

pytestmark = pytest.mark.integration

KV_CONFIG = kv_transfer_config(chunk_size=256, local_cpu=False, local_disk="{tmp}/kv", max_local_disk_size=1)


def chunk_files(directory: str) -> set[str]:
    """Chunk files, as paths relative to ``directory``."""
    return {os.path.relpath(p, directory) for p in disk_chunk_files(directory)}


def settled_chunk_files(directory: str, quiet_s: float = 1.0) -> set[str]:
    """The chunk files once background writes of earlier requests have stopped landing."""
    files, since = chunk_files(directory), time.monotonic()
    while time.monotonic() - since < quiet_s:
        time.sleep(0.1)
        now = chunk_files(directory)
        if now != files:
            files, since = now, time.monotonic()
    return files


def corrupt(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        tail = f.read(8)
        f.seek(-8, os.SEEK_END)
        f.write(bytes(b ^ 0xFF for b in tail))


def test_disk_hits_are_credited_to_the_disk_tier(serve_stack):
    srv = serve_stack.server
    before = srv.samples()
    x = prompt_tokens(600, 81)
    srv.complete(x)
    srv.reset_prefix_cache()
    hit = srv.complete(x)["kv_transfer_params"]["kvlens"]
    assert hit["loaded_tokens"] == {"disk": 512}

    def credited():
        s = srv.samples()
        d = sum_samples(s, "vllm:prompt_tokens_cached_by_source_total", source="disk") - sum_samples(
            before, "vllm:prompt_tokens_cached_by_source_total", source="disk"
        )
        return d if d == 512 else None

    wait_until(credited, what="vllm:prompt_tokens_cached_by_source{source=disk} += 512")
    after = srv.samples()
    assert sum_samples(after, "vllm:kvlens_tier_chunks", tier="disk") >= 2
    assert (
        sum_samples(after, "vllm:kvlens_load_tokens_total", tier="disk")
        - sum_samples(before, "vllm:kvlens_load_tokens_total", tier="disk")
    ) == 512


def test_failed_load_is_an_event_a_metric_an_error_span_and_a_recompute(serve_stack):
    srv, rx = serve_stack.server, serve_stack.receiver
    disk = serve_stack.kv_config["kv_connector_extra_config"]["lmcache.local_disk"]
    events_path = str(serve_stack.tmp / "events.jsonl")
    a = prompt_tokens(600, 91)
    existing = settled_chunk_files(disk)
    cold = srv.complete(a, max_tokens=8)
    # Disk writes finish in the background; the two whole chunks of this prompt appear whole.
    written = wait_until(
        lambda: (chunk_files(disk) - existing) if len(chunk_files(disk) - existing) >= 2 else None,
        what="the prompt's chunk files",
    )
    assert len(written) == 2
    for name in written:
        corrupt(Path(disk, name))
    srv.reset_prefix_cache()
    before = srv.samples()
    trace = "d4" * 16
    failed = srv.complete(a, max_tokens=8, traceparent=traceparent(trace))

    # vLLM recomputed the blocks: same greedy output as the cold run.
    assert failed["choices"][0]["text"] == cold["choices"][0]["text"]
    k = failed["kv_transfer_params"]["kvlens"]
    assert k["failed_blocks"] == 4 and k["recomputed_tokens"] == 512 and k["loaded_tokens"] == {}

    events = wait_until(
        lambda: [e for e in read_events(events_path) if e["request_id"].startswith(failed["id"])],
        what="the failed-load event",
    )
    (event,) = events
    assert event["tier"] == "disk" and len(event["block_ids"]) == 4 and event["tokens_affected"] == 512
    assert event["reason"].startswith("corrupt") and event["recomputed"] is True

    spans = rx.wait_for(lambda got: any(s.trace_id == trace and s.name == "kvlens.load" for s in got))
    (load,) = [s for s in spans if s.trace_id == trace and s.name == "kvlens.load"]
    assert load.status_code == 2 and load.attributes["error.type"] == "corrupt"
    assert load.attributes["kvlens.failed_blocks"] == 4
    (failure,) = [attrs for name, attrs in load.events if name == "kvlens.load_failed"]
    assert sorted(failure["kvlens.block_ids"]) == sorted(event["block_ids"])

    def delta(name, **labels):
        return sum_samples(srv.samples(), name, **labels) - sum_samples(before, name, **labels)

    wait_until(lambda: delta("vllm:kvlens_failed_blocks_total", reason="corrupt") == 4, what="failed blocks")
    assert delta("vllm:kvlens_recomputed_tokens_total") == 512
    assert delta("vllm:kvlens_failed_load_requests_total") == 1
    assert delta("vllm:kvlens_failed_chunks_total", operation="load", tier="disk", reason="corrupt") >= 1

    def no_pins():
        s = srv.samples()
        return all(
            sample(s, n, **lbl) == 0
            for n, lbl in (
                ("vllm:kvlens_pinned_requests", {}),
                ("vllm:kvlens_pinned_chunks", {"tier": "disk"}),
                ("vllm:kvlens_request_trackers", {}),
                ("vllm:kvlens_invalid_block_ids", {}),
            )
        )

    wait_until(no_pins, what="pins released after the failed load")
    assert json.loads(Path(events_path).read_text().splitlines()[-1])["event"] == "load_failed"


def test_background_write_queue_gauge_settles_to_zero_when_the_engine_goes_idle(serve_stack):
    srv = serve_stack.server
    threads = [
        threading.Thread(target=srv.complete, args=(prompt_tokens(1500, 200 + i),), kwargs={"max_tokens": 1})
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    # The last request ends before its disk writes land; the engine keeps stepping until they
    # did, so the gauge reaches zero instead of keeping its last busy value.
    wait_until(
        lambda: sample(srv.samples(), "vllm:kvlens_pending_writes") == 0,
        timeout=30,
        what="vllm:kvlens_pending_writes back to 0",
    )
