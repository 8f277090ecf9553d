"""Real ``vllm serve`` (CPU) with KVLens at default settings and requests of several tenants
(two cache salts, a key tag, none): the per-tenant series on /metrics against counts taken from
the responses themselves, and no salt or tag value anywhere on /metrics."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from connector.engine.tenants import TenantIds

from .serve import VllmServer, base_env, kv_transfer_config, prompt_tokens, sample, sum_samples, wait_until

pytestmark = pytest.mark.integration

SALTS = ("alice-9c1e5f0b7d2a4e61", "bob-4a7d2c9e8f1b3a50")
TAG = "carol-secret-team"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    env = base_env(XDG_STATE_HOME=str(tmp / "state"))  # a CPU tier only: the key is kept there
    srv = VllmServer(tiny_model, kv_transfer_config(), tmp / "serve.log", env, worker_process=False)
    try:
        srv.wait_ready()
        srv.tenant_ids = TenantIds((tmp / "state" / "kvlens" / "tenant-id-key").read_bytes())
        yield srv
    finally:
        srv.stop()


def tenants(ids: TenantIds) -> list[SimpleNamespace]:
    """Each tenant: its request parameters and the id its series is labelled with (under the
    key the server generated and kept)."""
    value_id = ids.value_id
    out = [
        SimpleNamespace(extra={"cache_salt": salt}, id=f"salt:{value_id(salt)}", seed=i)
        for i, salt in enumerate(SALTS)
    ]
    out.append(
        SimpleNamespace(
            extra={"kv_transfer_params": {"lmcache.tag.user": TAG}}, id=f"user:{value_id(TAG)}", seed=2
        )
    )
    out.append(SimpleNamespace(extra={}, id="default", seed=3))
    return out


def test_per_tenant_hits_loads_and_bytes_match_the_responses(server, tmp_path):
    before = server.samples()
    assert sample(before, "vllm:kvlens_tenant_hit_tokens_total", tenant="default") == 0
    assert sample(before, "vllm:kvlens_tenant_hit_tokens_total", tenant="other") == 0
    looked_up: dict[str, int] = {}
    cached: dict[str, int] = {}
    shared = prompt_tokens(600, seed=99)  # one prompt for every tenant: their KV never mixes
    for repeat in (False, True):
        if repeat:
            server.reset_prefix_cache()  # vLLM's own cache: the repeats load from KVLens
        for t in tenants(server.tenant_ids):
            for prompt in (shared, prompt_tokens(700, seed=t.seed)):
                body = server.complete(prompt, **t.extra)
                looked_up[t.id] = looked_up.get(t.id, 0) + len(prompt)
                hit = body["kv_transfer_params"]["num_lmcache_cached_tokens"]
                assert body["kv_transfer_params"]["kvlens"].get("tenant", "default") == t.id
                cached[t.id] = cached.get(t.id, 0) + hit
    assert all(n > 0 for n in cached.values())  # each tenant's repeats hit its own chunks only

    def counted():
        s = server.samples()
        return (
            all(
                sample(s, "vllm:kvlens_tenant_lookup_tokens_total", tenant=tid) == looked_up[tid]
                for tid in looked_up
            )
            and s
        )

    s = wait_until(counted, timeout=30, what="per-tenant lookups on /metrics")
    for tid, n in cached.items():
        assert sample(s, "vllm:kvlens_tenant_hit_tokens_total", tenant=tid) == n
        assert 0 < sample(s, "vllm:kvlens_tenant_load_tokens_total", tenant=tid) <= n
        assert sample(s, "vllm:kvlens_tenant_bytes", tenant=tid, tier="cpu") > 0
    assert sum_samples(s, "vllm:kvlens_tenant_hit_tokens_total") == sum_samples(
        s, "vllm:kvlens_hit_tokens_total"
    )
    assert sample(s, "vllm:kvlens_tenant_lookup_tokens_total", tenant="other") == 0

    def bytes_agree():
        s = server.samples()
        held = sum_samples(s, "vllm:kvlens_tenant_bytes", tier="cpu")
        return held == sum_samples(s, "vllm:kvlens_tier_used_bytes", tier="cpu") and held

    wait_until(bytes_agree, timeout=30, what="tenants' bytes = the CPU tier's bytes")

    text = server.metrics_text()
    (tmp_path / "metrics.txt").write_text(text)  # the dashboards' canned tenant series come from here
    for secret in (*SALTS, TAG, "alice", "bob", "carol"):
        assert secret not in text


def test_an_over_long_tag_is_served_without_kvlens_and_counted(server):
    """Client-sized state (issue 26 item 16): the request is answered as vLLM alone answers it,
    its response says why KVLens stayed out, and /metrics counts the refusal by reason. (vLLM's
    server itself refuses a cache_salt over 128 characters; tags reach KVLens as sent.)"""
    prompt = prompt_tokens(600, seed=77)
    body = server.complete(prompt, kv_transfer_params={"lmcache.tag.user": "x" * 5000})
    usage = body["kv_transfer_params"]["kvlens"]
    assert usage["miss_reason"] == "invalid_params" and "tenant" not in usage
    assert body["choices"][0]["text"] == server.complete(prompt)["choices"][0]["text"]

    def counted():
        s = server.samples()
        return sample(s, "vllm:kvlens_tenant_refusals_total", reason="tag_too_long") == 1 and s

    s = wait_until(counted, timeout=30, what="the refusal on /metrics")
    assert sample(s, "vllm:kvlens_tenant_refusals_total", reason="salt_too_long") == 0  # exported at 0
