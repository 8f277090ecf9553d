"""Retention and quotas through the scheduler's planner: what the plans write and evict is what
the index holds after every step, a retained prefix outlives a flood, hits retain, and a
tenant's quota keeps its chunks from pushing out another's."""

from connector.engine.jobs import CPU, Eviction, StoreJob
from connector.engine.tenants import value_id

from .fakes import BLOCK_BYTES, LAYERS, admit_fully, blocks, cpu_gb, request, scheduler

CHUNK = 2 * BLOCK_BYTES * LAYERS
SYSTEM = list(range(5000, 5512))  # two chunks
RETAIN = {"kvlens.retention_priority": 2, "kvlens.retain_for_s": 600}
ALLOWED = {"retention_allowed": ["default"]}  # requests without salt or tag may retain


class TierReplica:
    """What a CPU tier holds when it carries out exactly the plans' writes."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def apply(self, plan) -> None:
        for w in plan.writes:
            if isinstance(w, Eviction) and w.tier == CPU:
                self.names.discard(w.name)
            elif isinstance(w, StoreJob) and CPU in w.tiers:
                self.names.add(w.name)


def one_off(i: int) -> list[int]:
    return list(range(10000 + 600 * i, 10000 + 600 * i + 512))


def test_a_retained_prefix_outlives_a_flood_and_the_tier_matches_the_index_after_every_step():
    s = scheduler(max_local_cpu_size=cpu_gb(8 * CHUNK), extra_config=ALLOWED)
    tier, replica = s.tiers[CPU], TierReplica()
    _, plan = admit_fully(s, request("other", list(range(7000, 7512))), blocks(0, 4))
    replica.apply(plan)
    _, plan = admit_fully(s, request("sys", SYSTEM, kv_transfer_params=RETAIN), blocks(10, 4))
    replica.apply(plan)
    for i in range(8):
        _, plan = admit_fully(s, request(f"flood{i}", one_off(i)), blocks(20 + 4 * i, 4))
        replica.apply(plan)
        assert replica.names == set(tier.keys())
    assert s.lookup(request("again", SYSTEM + [1, 2, 3]), 0) == 512
    assert s.lookup(request("other2", list(range(7000, 7512)) + [1, 2, 3]), 0) == 0
    assert tier.bytes_by_class()[2] == 2 * CHUNK and tier.retained_evictions == 0
    sizes = s.sizes()
    (cpu,) = sizes.retention
    assert cpu.bytes_by_class[2] == 2 * CHUNK and sum(cpu.bytes_by_class) == tier.used_bytes


def test_a_request_that_hits_a_stored_prefix_retains_it():
    s = scheduler(max_local_cpu_size=cpu_gb(8 * CHUNK), extra_config=ALLOWED)
    admit_fully(s, request("a", SYSTEM), blocks(0, 4))
    assert s.tiers[CPU].bytes_by_class()[2] == 0
    admit_fully(s, request("b", SYSTEM + list(range(1, 100)), kv_transfer_params=RETAIN), blocks(10, 5))
    assert s.tiers[CPU].bytes_by_class()[2] == 2 * CHUNK


def test_a_bad_retention_value_is_stored_without_retention_and_counted():
    s = scheduler()
    r = request("a", SYSTEM, kv_transfer_params={"kvlens.retention_priority": "high"})
    _, plan = admit_fully(s, r, blocks(0, 4))
    assert len(plan.stores) == 2
    assert s.tiers[CPU].bytes_by_class()[0] == 2 * CHUNK
    assert s.state.policies["a"].ignored_params == 1


def test_a_tenant_at_its_quota_replaces_its_own_chunks_and_leaves_anothers():
    s = scheduler(
        max_local_cpu_size=cpu_gb(8 * CHUNK), extra_config={"tenant_quota_bytes": {"cpu": 2 * CHUNK}}
    )
    tier, replica = s.tiers[CPU], TierReplica()
    _, plan = admit_fully(s, request("b", SYSTEM, cache_salt="b"), blocks(0, 4))
    replica.apply(plan)
    for i in range(3):
        _, plan = admit_fully(s, request(f"a{i}", one_off(i), cache_salt="a"), blocks(10 + 4 * i, 4))
        replica.apply(plan)
        assert replica.names == set(tier.keys())
    a, b = (f"salt:{value_id(s)}" for s in "ab")
    assert tier.tenant_bytes(a) == 2 * CHUNK and tier.tenant_bytes(b) == 2 * CHUNK
    assert tier.quota_evictions == 4
    assert s.lookup(request("b2", SYSTEM + [1], cache_salt="b"), 0) == 512
