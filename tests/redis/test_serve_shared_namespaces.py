"""Two real ``vllm serve`` instances sharing one disk directory and one redis-server: the second
explains why a prompt the first stored under another cache salt or other tag values misses
(``other_namespace`` and what differs, never the values), and tells routers on vLLM's KV event
stream that chunks it loads from disk or Redis are now in its CPU memory (``medium: cpu``)."""

from __future__ import annotations

import json
import os

import pytest

from ..telemetry.serve import EventStream, VllmServer, base_env, kv_transfer_config, prompt_tokens, wait_until
from .test_serve_remote import LOOKUP_BUDGET, writes_landed

pytestmark = pytest.mark.integration

SALTED, TAGGED, ON_DISK, IN_REDIS = (prompt_tokens(600, s) for s in (71, 72, 73, 74))


def _kv(disk: str, redis_url: str) -> dict:
    return kv_transfer_config(
        chunk_size=256,
        max_local_cpu_size=1,
        local_disk=disk,
        max_local_disk_size=1,
        remote_url=redis_url,
        extra_config={"remote_key_prefix": "shared-ns", **LOOKUP_BUDGET},
    )


def _chunk_files(disk: str) -> set[str]:
    return {
        os.path.join(folder, f)
        for folder, _, names in os.walk(disk)
        if ".kvlens-namespaces" not in folder
        for f in names
        if f.endswith(".kvlens")
    }


def _kvlens(response) -> dict:
    return response["kv_transfer_params"]["kvlens"]


def test_a_second_instance_explains_misses_by_namespace_and_announces_promotions(
    redis_server, tiny_model, tmp_path
):
    from vllm.distributed.kv_events import BlockStored

    disk = str(tmp_path / "disk")
    os.makedirs(disk)
    kv = _kv(disk, redis_server.url)
    first = VllmServer(
        tiny_model, kv, tmp_path / "a.log", base_env(), ("--dtype", "float32"), worker_process=False
    )
    try:
        first.wait_ready()
        first.complete(SALTED, max_tokens=2, cache_salt="tenant-x-secret")
        first.complete(TAGGED, max_tokens=2, kv_transfer_params={"lmcache.tag.team": "blue-secret"})
        first.complete(ON_DISK, max_tokens=2)
        writes_landed(first)
        before = _chunk_files(disk)
        first.complete(IN_REDIS, max_tokens=2)
        writes_landed(first)
    finally:
        first.stop()  # writes the first-chunk marks still queued
    for path in _chunk_files(disk) - before:  # the disk let IN_REDIS go: only Redis holds it
        os.unlink(path)

    stream = EventStream()  # bound before vLLM is told its port
    env = base_env(KVLENS_REQUEST_LOG=str(tmp_path / "requests.jsonl"))
    args = ("--dtype", "float32", *stream.vllm_args())
    second = VllmServer(tiny_model, kv, tmp_path / "b.log", env, args, worker_process=False)
    try:
        second.wait_ready()
        salted = _kvlens(second.complete(SALTED, max_tokens=2, cache_salt="tenant-y-secret"))
        tagged = _kvlens(
            second.complete(TAGGED, max_tokens=2, kv_transfer_params={"lmcache.tag.team": "green"})
        )
        for usage in (salted, tagged):  # a client never learns another tenant stored its prompt
            assert usage["miss_reason"] == "not_stored" and "miss_detail" not in usage

        stream.drain(2.0)  # the publisher has connected
        stream.events.clear()
        assert _kvlens(second.complete(ON_DISK, max_tokens=2))["loaded_tokens"] == {"disk": 512}
        assert _kvlens(second.complete(IN_REDIS, max_tokens=2))["loaded_tokens"] == {"remote": 512}
        second.complete(prompt_tokens(8, 75), max_tokens=1)  # events go out with a step
        got = stream.drain(3.0)
        ours = [list(e.token_ids) for e in got if isinstance(e, BlockStored) and e.medium == "cpu"]
        for prompt in (ON_DISK, IN_REDIS):  # promoted into the CPU tier: stores in cpu
            assert prompt[:256] in ours and prompt[256:512] in ours

        log = tmp_path / "requests.jsonl"
        wait_until(lambda: log.exists() and len(log.read_text().splitlines()) >= 2, what="request log")
        records = [json.loads(x) for x in log.read_text().splitlines()]
        assert [r["miss_detail"] for r in records[:2]] == [
            {"differs_in": ["cache_salt"]},
            {"differs_in": ["tags"]},
        ]
        from dashboard import request_records  # the app's "Why did this request miss?" view

        frame, _ = request_records.load_requests([str(log)])
        shown = request_records.explain(request_records.find_request(frame, records[0]["request_id"]).iloc[0])
        assert "Missed: other_namespace" in shown and "cache_salt" in shown, shown
    finally:
        log = tmp_path / "requests.jsonl"
        stream.close()
        second.stop()
    dump = b"".join(open(p, "rb").read() for p in _all_files(disk))
    dump += b"".join(
        v for k in redis_server.client().keys("shared-ns:ns*") if (v := redis_server.client().get(k))
    )
    assert b"secret" not in dump and b"green" not in dump
    assert "secret" not in log.read_text()


def _all_files(root: str) -> list[str]:
    return [os.path.join(folder, f) for folder, _, names in os.walk(root) for f in names]
