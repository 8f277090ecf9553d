"""Operating a real ``vllm serve`` (CPU, tiny model) with CPU, disk and Redis tiers: ``kvlens
inspect`` shows what it stored by namespace, ``kvlens clear`` through its admin endpoint takes
one tenant out of every tier while loads run and everything out with ``AllBlocksCleared`` on the
event stream, and ``kvlens doctor`` reads its /metrics."""

from __future__ import annotations

import json
import threading

import pytest

from connector.ops.cli import main

from ..telemetry.serve import (
    EventStream,
    VllmServer,
    base_env,
    free_port,
    kv_transfer_config,
    prompt_tokens,
    sample,
    sum_samples,
    wait_until,
)
from .test_serve_remote import LOOKUP_BUDGET

pytestmark = pytest.mark.integration

PREFIX = "ops"


@pytest.fixture(scope="module")
def stack(server_factory_module, tiny_model, tmp_path_factory):
    from types import SimpleNamespace

    redis = server_factory_module()
    tmp = tmp_path_factory.mktemp("operating")
    admin_port = free_port()
    stream = EventStream()  # bound before vLLM is told its port
    kv = kv_transfer_config(
        chunk_size=256,
        max_local_cpu_size=1,
        local_disk=str(tmp / "disk"),
        max_local_disk_size=1,
        remote_url=redis.url,
        extra_config={"remote_key_prefix": PREFIX, "admin_port": admin_port, **LOOKUP_BUDGET},
    )
    args = ("--dtype", "float32", *stream.vllm_args())
    srv = VllmServer(tiny_model, kv, tmp / "serve.log", base_env(), args, worker_process=False)
    try:
        srv.wait_ready()
        yield SimpleNamespace(
            srv=srv,
            redis=redis,
            disk=str(tmp / "disk"),
            admin=f"http://127.0.0.1:{admin_port}",
            events=stream,
        )
    finally:
        srv.stop()
        stream.close()


def kvlens(capsys, *argv) -> dict:
    code = main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def loaded(response) -> dict:
    return response["kv_transfer_params"]["kvlens"]["loaded_tokens"]


def settled(srv) -> None:
    """Background disk and Redis writes landed. An idle engine publishes no stats, so a short
    request (too short to store anything) carries the workers' latest count."""

    def landed():
        srv.complete(prompt_tokens(8, 5), max_tokens=1)
        return sample(srv.samples(), "vllm:kvlens_pending_writes") == 0

    wait_until(landed, what="writes landed")


def info(srv) -> dict:
    (labels,) = [dict(ls) for (n, ls) in srv.samples() if n == "vllm:kvlens_info"]
    return labels


def test_inspect_shows_each_tenant_of_a_real_server_in_disk_and_redis(stack, capsys):
    srv = stack.srv
    srv.complete(prompt_tokens(600, 1), max_tokens=2)
    srv.complete(prompt_tokens(600, 2), max_tokens=2, cache_salt="tenant-a-secret")
    srv.complete(prompt_tokens(600, 3), max_tokens=2, kv_transfer_params={"lmcache.tag.team": "blue-secret"})
    settled(srv)
    expect = info(srv)
    for target in (stack.disk, stack.redis.url):
        report = wait_until(
            lambda t=target: (
                (r := kvlens(capsys, "inspect", t, "--prefix", PREFIX))
                and sum(n["described"] for n in r["namespaces"]) >= 3
                and r
            ),
            what="namespace records written",
        )
        assert report["damaged_records"] == 0 and report["chunks"] >= 6
        by_fp = {n["fingerprint"]: n for n in report["namespaces"]}
        base = by_fp[expect["key_fingerprint"]]  # the engine's own key fingerprint, as on /metrics
        assert base["chunks"] >= 2 and not base["salted"] and base["tags"] == []
        assert base["model"] == expect["model_identity"] and base["quantization"] == expect["quantization"]
        others = [n for fp, n in by_fp.items() if fp != expect["key_fingerprint"]]
        assert sorted((n["salted"], tuple(n["tags"])) for n in others) == [(False, ("team",)), (True, ())]
        assert all(n["chunks"] >= 2 for n in others)
        assert report["age_histogram"]["< 1 min"] + report["age_histogram"]["< 10 min"] == report["records"]
    assert "secret" not in capsys.readouterr().out


def test_clearing_one_tenant_through_the_server_keeps_running_loads_whole(stack, capsys):
    srv = stack.srv
    mine = prompt_tokens(600, 11)
    cold = srv.complete(mine, max_tokens=4, cache_salt="tenant-b")
    settled(srv)
    srv.reset_prefix_cache()
    assert loaded(srv.complete(mine, max_tokens=4, cache_salt="tenant-b")) == {"cpu": 512}
    failed_before = sum_samples(srv.samples(), "vllm:kvlens_failed_blocks_total")

    texts, stop = [], threading.Event()

    def keep_loading():  # requests whose lookups and loads are under way while the clear applies
        while not stop.is_set():
            srv.reset_prefix_cache()
            texts.append(srv.complete(mine, max_tokens=4, cache_salt="tenant-b")["choices"][0]["text"])

    loaders = [threading.Thread(target=keep_loading) for _ in range(2)]
    for loader in loaders:
        loader.start()
    try:
        wait_until(lambda: len(texts) >= 2, what="loads under way")
        result = kvlens(capsys, "clear", stack.admin, "--salt", "tenant-b")
        during = len(texts)
        wait_until(lambda: len(texts) >= during + 2, what="requests after the clear")
    finally:
        stop.set()
        for loader in loaders:
            loader.join(60)
    assert result["engine"]["applied"] and result["engine"]["index_dropped"]["cpu"] >= 2
    assert (
        result["disk"]["chunks"] >= 2 and result["remote"]["chunks"] >= 2 and len(result["namespaces"]) == 1
    )
    assert set(texts) == {cold["choices"][0]["text"]}
    assert sum_samples(srv.samples(), "vllm:kvlens_failed_blocks_total") == failed_before  # no load failed


def test_clearing_one_tenant_through_the_server_takes_it_from_every_tier_and_leaves_the_others(stack, capsys):
    srv = stack.srv
    mine, theirs = prompt_tokens(600, 13), prompt_tokens(600, 14)
    srv.complete(mine, max_tokens=4, cache_salt="tenant-d")
    srv.complete(theirs, max_tokens=4, cache_salt="tenant-e")
    settled(srv)
    result = kvlens(capsys, "clear", stack.admin, "--salt", "tenant-d")
    (cleared,) = result["namespaces"]
    assert (
        result["disk"]["chunks"]
        == result["remote"]["chunks"]
        == result["engine"]["index_dropped"]["cpu"]
        == 2
    )
    for target in (stack.disk, stack.redis.url):
        left = {n["fingerprint"] for n in kvlens(capsys, "inspect", target, "--prefix", PREFIX)["namespaces"]}
        assert cleared not in left
    srv.reset_prefix_cache()
    assert loaded(srv.complete(theirs, max_tokens=4, cache_salt="tenant-e")) == {"cpu": 512}
    assert loaded(srv.complete(mine, max_tokens=4, cache_salt="tenant-d")) == {}


def test_clearing_everything_through_the_server_tells_routers_without_another_request(stack, capsys):
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved

    srv = stack.srv
    srv.complete(prompt_tokens(600, 21), max_tokens=2)
    settled(srv)
    stream = stack.events
    stream.drain(2.0)  # the publisher has connected (and sent what it queued meanwhile)
    stream.events.clear()
    result = kvlens(capsys, "clear", stack.admin, "--all")
    events = stream.drain(3.0)  # the endpoint woke the idle engine, which published
    assert any(isinstance(e, AllBlocksCleared) for e in events)
    assert any(isinstance(e, BlockRemoved) and e.medium == "cpu" for e in events)
    assert result["disk"]["chunks"] >= 2 and result["remote"]["chunks"] >= 2
    for target in (stack.disk, stack.redis.url):
        assert kvlens(capsys, "inspect", target, "--prefix", PREFIX)["chunks"] == 0
    srv.reset_prefix_cache()
    assert loaded(srv.complete(prompt_tokens(600, 21), max_tokens=2)) == {}


def test_vllms_reset_with_reset_external_is_announced_by_kvlens_too(stack):
    from vllm.distributed.kv_events import AllBlocksCleared

    srv = stack.srv
    srv.complete(prompt_tokens(600, 31), max_tokens=2)
    stream = stack.events
    stream.drain(2.0)
    stream.events.clear()
    srv.post("/reset_prefix_cache?reset_external=true")
    srv.complete(prompt_tokens(8, 32), max_tokens=1)  # vLLM publishes with its next step
    cleared = [e for e in stream.drain(3.0) if isinstance(e, AllBlocksCleared)]
    assert len(cleared) == 2  # vLLM's own prefix cache, and KVLens's tiers


def test_doctor_reads_the_servers_metrics(stack, capsys):
    srv = stack.srv

    def whatif_published():
        srv.complete(prompt_tokens(600, 41), max_tokens=1)
        return (
            sample(srv.samples(), "vllm:kvlens_whatif_hit_ratio", tier="cpu", budget_factor="1") is not None
        )

    wait_until(whatif_published, timeout=60, interval=1.1, what="what-if gauges")
    result = kvlens(capsys, "doctor", srv.url, srv.url + "/metrics")
    assert result["unreachable"] == {} and result["cannot_share"] == []
    assert result["share_groups"] == [[srv.url, srv.url + "/metrics"]]
    first = result["instances"][0]
    assert first["identity"]["key_fingerprint"] == info(srv)["key_fingerprint"]
    assert first["tiers"] == ["cpu tier: healthy", "disk tier: healthy", "remote tier: healthy"]
    assert any(a.startswith("cpu tier:") for a in first["advice"])


def test_connections_redis_drops_are_reopened_in_the_background_not_in_a_lookup(stack):
    """Redis drops every KVLens connection (a restart, a proxy closing idle ones): the scheduler's
    lookup connection is back within a keepalive period with no request asking, and the next
    request's lookup is answered (neither lookup_timeout nor tier_unhealthy)."""
    client = stack.redis.client()

    def kvlens_connections() -> int:
        return sum(1 for c in client.client_list() if c.get("name") == "kvlens")

    assert kvlens_connections() >= 1  # opened at start-up
    assert client.client_kill_filter(_type="normal", skipme=True) >= 1
    wait_until(kvlens_connections, timeout=10, interval=0.1, what="a KVLens connection re-opened")
    response = stack.srv.complete(prompt_tokens(600, 43), max_tokens=1)
    assert response["kv_transfer_params"]["kvlens"]["miss_reason"] == "not_stored", response
