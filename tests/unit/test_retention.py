"""Retention and tenant quotas in a tier index: retained chunks go last and expire, the cap
demotes, a tenant at its quota evicts only its own, pins still hold, and what admit reports
evicted is exactly what left the index."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.engine.index import TierIndex
from connector.engine.keys import Namespace
from connector.engine.policy import decide_policy
from connector.engine.retention import Retention, parse_retention
from connector.engine.tenants import tenant_id, value_id

from .test_properties import json_values


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def index(capacity: int = 4, share: float = 1.0, quota: int | None = None, policy: str = "LRU"):
    clock = Clock()
    return TierIndex("cpu", capacity, None, policy, share, quota, clock), clock


KEEP = Retention(1, None)


# ---- request parameters ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("params", "want"),
    [
        ({}, None),
        ({"kvlens.retention_priority": 0}, None),
        ({"kvlens.retention_priority": 2}, Retention(2, None)),
        ({"kvlens.retain_for_s": 60}, Retention(1, 60.0)),
        ({"kvlens.retention_priority": 3, "kvlens.retain_for_s": 1.5}, Retention(3, 1.5)),
    ],
)
def test_retention_params_are_read(params, want):
    assert parse_retention(params) == want


@pytest.mark.parametrize(
    "params",
    [
        {"kvlens.retention_priority": 4},
        {"kvlens.retention_priority": -1},
        {"kvlens.retention_priority": True},
        {"kvlens.retention_priority": "2"},
        {"kvlens.retain_for_s": 0},
        {"kvlens.retain_for_s": float("nan")},
        {"kvlens.retain_for_s": float("inf")},
        {"kvlens.retain_for_s": 10**5000},
    ],
)
def test_bad_retention_is_served_without_it_and_counted(params):
    base = Namespace("m", "bf16", "L")
    policy = decide_policy(base, "r", params, None, None, 0, False, "kv_both", None, False)
    assert policy.namespace is not None and policy.skip_reason is None  # served, cached
    assert policy.retention is None and policy.ignored_params == 1


def test_unknown_kvlens_params_are_counted():
    base = Namespace("m", "bf16", "L")
    params = {"kvlens.retain_for": 5, "kvlens.retention_priority": 1}
    policy = decide_policy(base, "r", params, None, None, 0, False, "kv_both", None, False)
    assert policy.ignored_params == 1 and policy.retention == KEEP


def test_tenant_is_the_cache_salt_and_tags():
    base = Namespace("m", "bf16", "L")
    assert tenant_id(base) == "default"  # one tenant identity for quotas and accounting
    assert (
        tenant_id(base.with_request(None, "s1", {"user": "a"}))
        == f"salt:{value_id('s1')},user:{value_id('a')}"
    )
    policy = decide_policy(base, "r", {"lmcache.tag.user": "a"}, None, None, 0, False, "kv_both", None, False)
    assert policy.tenant == f"user:{value_id('a')}"


# ---- eviction order ------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["LRU", "LFU", "FIFO", "MRU"])
def test_retained_chunks_are_evicted_after_every_unretained_one(policy):
    tier, _ = index(4, policy=policy)
    tier.admit("kept", 1, KEEP)
    for k in ("a", "b", "c"):
        tier.admit(k, 1)
    evicted = [v for k in ("d", "e", "f") for v in tier.admit(k, 1)]
    assert len(evicted) == 3 and "kept" not in evicted and "kept" in tier  # MRU: the newest go
    assert tier.retained_evictions == 0


def test_retained_go_last_lowest_priority_then_earliest_end_first():
    tier, _ = index(4)
    tier.admit("p2", 1, Retention(2, None))
    tier.admit("p1-late", 1, Retention(1, 100))
    tier.admit("p1-soon", 1, Retention(1, 10))
    tier.admit("p3", 1, Retention(3, 5))
    assert tier.admit("x", 1) == ["p1-soon"]
    assert tier.admit("y", 2) == ["x", "p1-late"]
    assert tier.retained_evictions == 2
    assert "p2" in tier and "p3" in tier


def test_retention_expires_and_the_chunk_becomes_normal():
    tier, clock = index(3)
    tier.admit("old", 1)
    tier.admit("kept", 1, Retention(2, 30))
    tier.admit("new", 1)
    assert tier.bytes_by_class() == (2, 0, 1, 0)
    clock.now += 31
    assert tier.bytes_by_class() == (3, 0, 0, 0)
    assert tier.admit("x", 1) == ["kept"]  # normal again, and the first to go
    assert tier.admit("y", 1) == ["old"]
    assert tier.retained_evictions == 0


def test_a_chunk_keeps_the_highest_priority_and_latest_end_any_request_gave_it():
    tier, clock = index(4)
    tier.admit("k", 1, Retention(1, 10))
    tier.admit("k", 1, Retention(3, 5))  # stored again by another request
    tier.retain("k", Retention(2, 50))  # and hit by a third
    assert tier.retention.priority("k") == 3
    clock.now += 40
    assert tier.bytes_by_class() == (0, 0, 0, 1)
    clock.now += 11
    assert tier.bytes_by_class() == (1, 0, 0, 0)


def test_a_chunk_evicted_and_stored_again_is_listed_once():
    tier, _ = index(1)
    tier.admit("k", 1, KEEP)
    assert tier.admit("x", 1) == ["k"]
    tier.admit("k", 1, KEEP)
    assert tier.keys() == ["k"] and tier.bytes_by_class() == (0, 1, 0, 0)


def test_a_hit_retains_a_stored_chunk():
    tier, _ = index(2)
    tier.admit("a", 1)
    tier.admit("b", 1)
    tier.retain("a", KEEP)
    assert tier.admit("c", 1) == ["b"]


def test_pinned_chunks_are_never_evicted_retained_or_not():
    tier, _ = index(3)
    tier.admit("pinned", 1)
    tier.pin("pinned")
    tier.admit("kept", 1, KEEP)
    tier.admit("n", 1)
    assert tier.admit("x", 3) is None  # only 2 bytes evictable: nothing is evicted
    assert len(tier) == 3
    assert tier.admit("x", 1) == ["n"]
    assert tier.admit("y", 1) == ["x"]
    assert tier.admit("z", 2) == ["y", "kept"]
    assert "pinned" in tier


# ---- the operator's cap ----------------------------------------------------------------
def test_retained_bytes_beyond_the_cap_are_demoted_lowest_first():
    tier, _ = index(10, share=0.3)
    tier.admit("p3", 1, Retention(3, None))
    tier.admit("p1", 1, Retention(1, None))
    tier.admit("p2", 1, Retention(2, None))
    tier.admit("p2b", 1, Retention(2, None))  # 4 > 3 allowed: p1 becomes normal
    assert "p1" not in tier.retention and len(tier.retention) == 3
    assert tier.retention.demotions == 1
    assert tier.bytes_by_class() == (1, 0, 2, 1)
    assert len(tier) == 4  # demoted, not evicted: the first to go
    assert tier.admit("x", 7) == ["p1"]


def test_a_zero_share_retains_nothing():
    tier, _ = index(2, share=0.0)
    tier.admit("a", 1, KEEP)
    tier.admit("b", 1)
    assert tier.admit("c", 1) == ["a"]


# ---- tenant quotas ---------------------------------------------------------------------
def test_a_tenant_at_its_quota_evicts_its_own_chunks_never_anothers():
    tier, _ = index(10, quota=2)
    tier.admit("b1", 1, tenant="b")
    tier.admit("a1", 1, tenant="a")
    tier.admit("a2", 1, tenant="a")
    tier.admit("b2", 1, tenant="b")
    assert tier.admit("a3", 1, tenant="a") == ["a1"]
    assert tier.quota_evictions == 1
    assert tier.tenant_bytes("a") == 2 and tier.tenant_bytes("b") == 2
    assert {"b1", "b2"} <= set(tier.keys())


def test_a_tenant_whose_own_chunks_are_pinned_is_refused():
    tier, _ = index(10, quota=1)
    tier.admit("a1", 1, tenant="a")
    tier.pin("a1")
    assert tier.admit("a2", 1, tenant="a") is None
    assert tier.quota_refusals == 1 and "a2" not in tier
    assert tier.admit("b1", 1, tenant="b") == []


def test_quota_and_budget_evict_together_without_double_counting():
    tier, _ = index(3, quota=2)
    tier.admit("a1", 1, tenant="a")
    tier.admit("a2", 1, tenant="a")
    tier.admit("b1", 1, tenant="b")
    # a is at its quota (drops a1), which also frees room in the full tier: b1 stays
    assert tier.admit("a3", 1, tenant="a") == ["a1"]
    assert tier.used_bytes == 3 and "b1" in tier


def test_a_quota_eviction_that_does_not_happen_is_not_counted():
    tier, _ = index(4, quota=3)
    tier.admit("a1", 1, tenant="a")
    tier.admit("b1", 3, tenant="b")
    tier.pin("b1")
    # a's own a1 makes room within its quota, but the tier needs b1's bytes too: nothing happens
    assert tier.admit("a2", 3, tenant="a") is None
    assert tier.quota_evictions == 0 and tier.quota_refusals == 0 and "a1" in tier


def test_a_tenants_quota_keeps_its_own_retained_chunks_last():
    tier, _ = index(10, quota=2)
    tier.admit("a-kept", 1, KEEP, tenant="a")
    tier.admit("a1", 1, tenant="a")
    assert tier.admit("a2", 1, tenant="a") == ["a1"]


def test_chunks_of_unknown_tenant_count_against_no_quota():
    tier, _ = index(10, quota=1)
    tier.add_known("other-engine", 1)
    tier.add_known("other-engine-2", 1)
    assert tier.admit("a1", 1, tenant="a") == []


# ---- the index and the tier agree ------------------------------------------------------
ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "admit", "admit", "retain", "pin", "unpin", "tick", "overflow"]),
        st.integers(0, 11),  # key
        st.integers(1, 3),  # size
        st.integers(0, 3),  # priority
        st.sampled_from([None, 5.0, 50.0]),  # seconds
        st.sampled_from(["a", "b", None]),  # tenant
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops, st.sampled_from(["LRU", "LFU", "FIFO", "MRU"]), st.sampled_from([None, 4]), st.floats(0, 1))
def test_admissions_report_exactly_what_left_the_index(ops, policy, quota, share):
    tier, clock = index(8, share=share, quota=quota, policy=policy)
    held: dict[str, int] = {}  # what a tier fed only by admit's reports would hold
    pinned: set[str] = set()
    for op, k, size, prio, seconds, tenant in ops:
        key, retention = f"k{k}", Retention(prio, seconds) if prio else None
        if op == "admit":
            evicted = tier.admit(key, size, retention, tenant)
            if evicted is not None:
                assert not pinned & set(evicted)
                for v in evicted:
                    del held[v]
                held.setdefault(key, size)
        elif op == "retain":
            tier.retain(key, retention)
        elif op == "pin" and key in tier:
            tier.pin(key)
            pinned.add(key)
        elif op == "unpin" and key in pinned:
            tier.unpin(key)
            pinned.discard(key)
        elif op == "tick":
            clock.now += 10
        elif op == "overflow":
            for v in tier.overflow_victims():
                del held[v]
        assert set(tier.keys()) == set(held)
        assert tier.used_bytes == sum(held.values()) <= 8
        assert sum(tier.bytes_by_class()) == tier.used_bytes and min(tier.bytes_by_class()) >= 0
        assert tier.retention.total_bytes() <= share * 8
        if quota is not None:
            assert all(tier.tenant_bytes(t) <= quota for t in ("a", "b"))


@settings(max_examples=300, deadline=None)
@given(json_values, json_values)
def test_any_retention_value_is_read_or_refused_cleanly(priority, seconds):
    base = Namespace("m", "bf16", "L")
    params = {"kvlens.retention_priority": priority, "kvlens.retain_for_s": seconds}
    policy = decide_policy(base, "r", params, None, None, 0, False, "kv_both", None, False)
    assert policy.namespace is not None  # always served and cached
    r = policy.retention
    assert r is None or (1 <= r.priority <= 3 and (r.seconds is None or 0 < r.seconds <= 30 * 86400))


def test_chunks_other_engines_wrote_overflow_before_retained_ones():
    tier, _ = index(3)
    tier.admit("kept", 1, KEEP)
    tier.admit("mine", 1)
    tier.add_known("theirs", 1)
    tier.add_known("theirs-too", 1)  # a shared disk directory grew beyond this engine's budget
    assert tier.overflow_victims() == ["theirs-too"]
    tier.add_known("more", 2)
    assert tier.overflow_victims() == ["more"]
    tier.pin("theirs")
    tier.pin("mine")
    tier.add_known("last", 1)  # only pinned and retained chunks left besides it
    assert tier.overflow_victims() == ["last"]
    tier.unpin("mine")
    tier.update_size("theirs", 2)
    assert tier.overflow_victims() == ["mine"]
    assert "kept" in tier and tier.retained_evictions == 0
