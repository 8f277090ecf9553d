"""First-chunk marks through a real redis-server: an engine that shares only the Redis prefix
with another explains its miss of a prompt the other stored under another namespace, and the
marks stay bounded and hold no salt, tag value or token."""

from __future__ import annotations

import time

import redis

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
