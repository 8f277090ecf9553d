"""First-chunk marks through a real redis-server: an engine that shares only the Redis prefix
with another explains its miss of a prompt the other stored under another namespace, and the
marks stay bounded and hold no salt, tag value or token."""

from __future__ import annotations

import time

import redis

from connector.engine.keys import Namespace
from connector.engine.namespace_marks import MAX_BUCKET_BYTES
from connector.engine.outcomes import MissReason

from ..unit.test_admin import PROMPT, Worker, _hashed, _scheduler, _store


def test_an_engine_sharing_only_redis_explains_a_miss_by_what_differs(redis_server, tmp_path):
    remote = {"remote_url": redis_server.url, "extra_config.remote_key_prefix": "marks1"}
    a = _scheduler(tmp_path / "a", **remote)
    try:
        _store(a, Worker(a), "a", kv_transfer_params={"lmcache.tag.team": "blue-secret"})
        raw = redis.Redis(port=redis_server.port)
        deadline = time.monotonic() + 10
        while not raw.keys("marks1:nsmark:*") and time.monotonic() < deadline:
            time.sleep(0.02)  # written at once, not at shutdown
        assert raw.keys("marks1:nsmark:*")
    finally:
        a.shutdown()
    b = _scheduler(tmp_path / "b", **remote)  # its own disk directory: only Redis is shared
    try:
        deadline = time.monotonic() + 10
        while not len(b.state.shared_marks.view) and time.monotonic() < deadline:
            time.sleep(0.02)
        req = _hashed("b", PROMPT, kv_transfer_params={"lmcache.tag.team": "red"})
        b.lookup(req, 0)
        result = b.state.lookups["b"]
        assert result.miss_reason is MissReason.OTHER_NAMESPACE
        assert result.miss_detail == {"differs_in": ["tags"]}
    finally:
        b.shutdown()
    values = [raw.get(k) for k in raw.keys("marks1:ns*")]
    assert all(b"secret" not in v for v in values)
    marks = [raw.get(k) for k in raw.keys("marks1:nsmark:*")]
    assert marks and all(len(v) <= MAX_BUCKET_BYTES for v in marks)


def test_engines_sharing_a_redis_prefix_agree_on_tenant_ids(redis_server, tmp_path):
    """The deployment's tenant-id key is created once in the shared prefix (SET NX): engines
    with their own disk directories but one Redis prefix count a tenant under one id."""
    from connector.config.loading import load_config
    from connector.engine.tenants import TenantIds
    from connector.scheduler.tenant_id_key import deployment_key

    keys = []
    for host in ("a", "b"):
        (tmp_path / host).mkdir()
        config = load_config(
            {
                "lmcache.local_disk": str(tmp_path / host),
                "lmcache.max_local_disk_size": 1,
                "lmcache.remote_url": redis_server.url,
                "lmcache.extra_config": {"remote_key_prefix": "ids1"},
            },
            env={},
        )
        keys.append(deployment_key(config))
    assert keys[0] == keys[1]
    assert redis.Redis(port=redis_server.port).exists("ids1:tenant-id-key")
    assert not list((tmp_path / "a").rglob("tenant-id-key"))  # the shared store's, not the host's
    other = load_config(
        {"lmcache.remote_url": redis_server.url, "lmcache.extra_config": {"remote_key_prefix": "ids2"}},
        env={},
    )
    salted = Namespace("m", "bfloat16", "L", cache_salt="s")
    assert TenantIds(keys[0]).tenant_id(salted) != TenantIds(deployment_key(other)).tenant_id(salted)
