"""The operator decides who retains and how much; quotas and per-tenant state stay bounded
however many salts one client rotates through."""

import pytest

from connector.engine.index import TierIndex
from connector.engine.jobs import CPU
from connector.engine.retention import Retention, RetentionBook
from connector.engine.retention_rules import CAPPED, NOT_ALLOWED, RetentionRules
from connector.engine.tenants import OTHER, value_id

from .fakes import BLOCK_BYTES, LAYERS, admit_fully, blocks, cpu_gb, request, scheduler, step

CHUNK = 2 * BLOCK_BYTES * LAYERS
SYSTEM = list(range(5000, 5512))  # two chunks
GREEDY = {"kvlens.retention_priority": 3}  # no end


def prompt(i: int, chunks: int = 1) -> list[int]:
    return list(range(20000 + 300 * i, 20000 + 300 * i + 256 * chunks))


def test_at_default_settings_a_retention_ask_is_ignored_and_counted():
    s = scheduler(max_local_cpu_size=cpu_gb(8 * CHUNK))
    r = request("a", SYSTEM, kv_transfer_params=GREEDY)
    outcome = s.after_alloc(r, s.lookup(r, 0))
    assert outcome.retention_refused == NOT_ALLOWED  # what the recorder counts
    plan = s.build_plan(step(new=[(r, blocks(0, 4), 0)], num_scheduled={"a": len(SYSTEM)}))
    assert len(plan.stores) == 2  # stored, as a normal chunk
    assert s.tiers[CPU].bytes_by_class() == (2 * CHUNK, 0, 0, 0)
    assert s.state.policies["a"].retention is None


def test_only_the_listed_tenants_retain():
    s = scheduler(max_local_cpu_size=cpu_gb(16 * CHUNK), extra_config={"retention_allowed": ["team=blue"]})
    admit_fully(
        s, request("x", prompt(0, 2), kv_transfer_params={**GREEDY, "lmcache.tag.team": "red"}), blocks(0, 4)
    )
    assert s.state.policies["x"].retention_refused == NOT_ALLOWED
    salted = request("y", prompt(1, 2), kv_transfer_params=GREEDY, cache_salt="rotating")
    admit_fully(s, salted, blocks(10, 4))
    assert s.state.policies["y"].retention_refused == NOT_ALLOWED
    assert s.tiers[CPU].bytes_by_class()[3] == 0
    admit_fully(
        s,
        request("z", prompt(2, 2), kv_transfer_params={**GREEDY, "lmcache.tag.team": "blue"}),
        blocks(20, 4),
    )
    policy = s.state.policies["z"]
    assert policy.retention == Retention(3, 86400.0) and policy.retention_refused is None
    assert s.tiers[CPU].bytes_by_class()[3] == 2 * CHUNK


def test_a_granted_ask_is_capped_and_never_without_an_end():
    rules = RetentionRules.of(["*"], max_priority=2, max_seconds=600.0)
    assert rules.grant(Retention(3, None), "default", {}) == (Retention(2, 600.0), CAPPED)
    assert rules.grant(Retention(1, None), "default", {}) == (Retention(1, 600.0), None)
    assert rules.grant(Retention(2, 7200.0), "default", {}) == (Retention(2, 600.0), CAPPED)
    assert rules.grant(Retention(1, 60.0), "default", {}) == (Retention(1, 60.0), None)
    assert rules.grant(None, "default", {}) == (None, None)
    none = RetentionRules.of(["*"], max_priority=0, max_seconds=600.0)
    assert none.grant(Retention(2, 60.0), "default", {}) == (None, CAPPED)
    by_id = RetentionRules.of([f"salt:{value_id('s')}"], 3, 600.0)
    assert by_id.allows(f"salt:{value_id('s')},team:{value_id('x')}", {"team": "x"})
    assert not by_id.allows(f"salt:{value_id('t')}", {}) and not RetentionRules().allows("default", {})


def test_a_retained_chunk_without_an_end_asked_becomes_normal_after_the_maximum():
    now = [0.0]
    tier = TierIndex(CPU, 8, clock=lambda: now[0])
    rules = RetentionRules.of(["*"], 3, 600.0)
    granted, _ = rules.grant(Retention(3, None), "default", {})
    tier.admit("kept", 1, granted, "default")
    assert tier.bytes_by_class()[3] == 1
    now[0] = 601.0
    assert tier.bytes_by_class() == (1, 0, 0, 0)


def test_one_tenant_retains_at_most_its_share_of_a_tier():
    book = RetentionBook(8, 0.5, lambda: 0.0, tenant_share=0.25)
    for key in ("a1", "a2", "a3"):
        book.retain(key, 1, Retention(2, None), "a")
    assert book.tenant_bytes("a") == 2 and "a1" not in book and book.demotions == 1  # its lowest went
    book.retain("b1", 1, Retention(1, None), "b")
    book.retain("b2", 1, Retention(1, None), "b")
    assert book.tenant_bytes("b") == 2 and book.total_bytes() == 4  # another's share untouched


@pytest.mark.parametrize("labels", [0, 2])
def test_a_client_rotating_salts_stays_within_the_joint_quota(labels):
    """Tenants beyond tenant_labels_max share the 'other' label, and its quota applies to them
    jointly: new salts get no new quota, and the index keeps no state per salt."""
    s = scheduler(
        max_local_cpu_size=cpu_gb(64 * CHUNK),
        extra_config={"tenant_quota_bytes": {"cpu": 2 * CHUNK}, "tenant_labels_max": labels},
    )
    tier = s.tiers[CPU]
    for i in range(30):
        admit_fully(s, request(f"r{i}", prompt(i), cache_salt=f"salt-{i}"), blocks(4 * i, 2))
    assert tier.used_bytes <= (labels + 1) * 2 * CHUNK  # its own labels' quotas and other's
    assert tier.tenant_bytes(OTHER) <= 2 * CHUNK
    assert len(tier._tenant_bytes) <= labels + 1


def test_per_tenant_retention_state_is_bounded_by_the_labels():
    s = scheduler(
        max_local_cpu_size=cpu_gb(64 * CHUNK),
        extra_config={"retention_allowed": ["*"], "tenant_labels_max": 2},
    )
    tier = s.tiers[CPU]
    for i in range(40):
        admit_fully(
            s, request(f"r{i}", prompt(i), kv_transfer_params=GREEDY, cache_salt=f"s{i}"), blocks(4 * i, 2)
        )
    assert len(tier.retention._tenant_bytes) <= 3 and len(tier.retention._tenant_ranks) <= 3
    assert tier.retention.tenant_bytes(OTHER) <= 0.25 * tier.capacity_bytes  # shared by salts 3..40
    assert len(tier._tenant_bytes) <= 3
