"""Planning rules that keep wrong KV out of every tier and the index equal to the tiers."""

from connector.engine.jobs import CPU, Eviction, StoreJob
from connector.engine.outcomes import FailureReason, MissReason, StoreFailure, TierState, WorkerReport

from .fakes import BLOCK_BYTES, LAYERS, admit_fully, blocks, cpu_gb, request, scheduler, step
from .test_scheduler import PROMPT, loaded

CHUNK = 2 * BLOCK_BYTES * LAYERS
LONG = list(range(3000, 4280))  # 1280 tokens: five chunks


def test_a_prompt_larger_than_the_tier_keeps_its_first_chunks_and_the_tier_matches_the_index():
    s = scheduler(max_local_cpu_size=cpu_gb(2 * CHUNK))
    _, plan = admit_fully(s, request("a", LONG), blocks(0, 10))
    assert [j.block_ids for j in plan.stores] == [(0, 1), (2, 3)]
    assert not plan.evictions
    assert s.tiers[CPU].used_bytes == 2 * CHUNK
    assert set(s.tiers[CPU].keys()) == {j.name for j in plan.stores}


def test_a_store_evicted_later_in_the_same_plan_is_cancelled_not_deleted_then_written():
    s = scheduler(max_local_cpu_size=cpu_gb(2 * CHUNK))
    a, b = request("a", PROMPT[:512]), request("b", list(range(8000, 8512)))
    for r in (a, b):
        s.lookup(r, 0)
        s.after_alloc(r, 0)
    plan = s.build_plan(
        step(new=[(a, blocks(0, 4), 0), (b, blocks(10, 4), 0)], num_scheduled={"a": 512, "b": 512})
    )
    written = {(j.name, t) for j in plan.stores for t in j.tiers}
    assert not plan.evictions  # nothing stored before this step: nothing to delete
    assert {name for name, _ in written} == set(s.tiers[CPU].keys())
    assert len(written) == 2


def test_stores_computed_over_a_load_of_the_same_step_name_the_loaded_blocks():
    s = scheduler()
    admit_fully(s, request("a", PROMPT[:512]), blocks(0, 4))
    b = request("b", PROMPT[:512] + list(range(9000, 9300)))
    need, plan = admit_fully(s, b, blocks(10, 7))
    assert need == 512
    (store,) = [j for j in plan.stores if j.num_tokens == 256]
    assert set(store.after_loads) == {10, 11, 12, 13}


def test_a_failed_load_makes_its_blocks_suspect_until_a_step_rewrites_them():
    s = scheduler()
    admit_fully(s, request("a", PROMPT), blocks(0, 5))
    b = request("b", PROMPT)
    _, plan = admit_fully(s, b, blocks(10, 5))
    s.on_worker_report(WorkerReport(loads={"b": loaded(plan.loads[0], fail_at=0)}))
    # the 4 failed blocks and b's tail block, computed over them in the same step
    assert s.sizes().suspect_blocks == 5
    # Another request got a prefix-cache hit in vLLM on b's (garbage) blocks before b recomputed.
    c = request("c", PROMPT[:512] + list(range(9000, 9400)))
    s.lookup(c, 512)
    s.after_alloc(c, 0)
    plan = s.build_plan(step(new=[(c, blocks(10, 4) + blocks(40, 4), 512)], num_scheduled={"c": 400}))
    assert not plan.stores  # its KV was computed over suspect blocks
    assert s.sizes().suspect_blocks == 9  # and so are the blocks it computed
    # b recomputes its blocks: they are sound again; c's own blocks stay wrong.
    plan = s.build_plan(step(cached=[("b", None, 0, False)], num_scheduled={"b": 600}))
    assert s.sizes().suspect_blocks == 4
    c.all_token_ids += [5]
    c.num_tokens += 1
    plan = s.build_plan(step(cached=[("c", None, 912, False)], num_scheduled={"c": 1}))
    assert not plan.stores
    # A request that reads b's rewritten blocks stores what it computes over them.
    d = request("d", PROMPT[:512] + list(range(7000, 7400)))
    s.lookup(d, 512)
    s.after_alloc(d, 0)
    plan = s.build_plan(step(new=[(d, blocks(10, 4) + blocks(50, 4), 512)], num_scheduled={"d": 400}))
    assert [j.block_ids for j in plan.stores][:1] == [(50, 51)]


def test_a_withdrawn_store_leaves_the_index_and_is_stored_again_after_the_rollback():
    s = scheduler()
    _, plan = admit_fully(s, request("a", PROMPT), blocks(0, 5))
    first = plan.stores[0]
    s.on_worker_report(
        WorkerReport(store_failures=[StoreFailure("a", first.name, CPU, FailureReason.DEPENDENCY_FAILED)])
    )
    assert first.name not in s.tiers[CPU]
    plan = s.build_plan(step(cached=[("a", None, 0, False)], num_scheduled={"a": 600}))
    assert Eviction(CPU, first.name) in plan.writes  # every rank drops its share
    assert [j.name for j in plan.stores] == [first.name]
    assert plan.writes.index(Eviction(CPU, first.name)) < plan.writes.index(plan.stores[0])


def test_later_chunks_of_a_prefix_whose_load_failed_leave_the_index_too():
    s = scheduler()
    admit_fully(s, request("a", LONG), blocks(0, 10))
    b = request("b", LONG)
    _, plan = admit_fully(s, b, blocks(20, 10))
    names = [c.name for c in plan.loads[0].chunks]
    s.on_worker_report(WorkerReport(loads={"b": loaded(plan.loads[0], fail_at=1)}))
    assert names[0] in s.tiers[CPU] and not any(n in s.tiers[CPU] for n in names[1:])
    assert s.lookup(request("c", LONG), 0) == 256


def test_blocks_vllm_allocated_beyond_what_kvlens_can_load_are_failed():
    s = scheduler()
    admit_fully(s, request("a", PROMPT[:256]), blocks(0, 2))
    b = request("b", PROMPT)
    assert s.lookup(b, 0) == 256
    s.after_alloc(b, 512)  # vLLM asks for more than KVLens offered
    plan = s.build_plan(step(new=[(b, blocks(10, 5), 512)], num_scheduled={"b": 88}))
    assert plan.fail_blocks == [12, 13]
    assert not plan.stores or all(set(j.after_loads) >= {12, 13} for j in plan.stores if j.block_ids[0] >= 12)


def test_prompt_logprobs_requests_take_no_pins_and_count_no_hit():
    s = scheduler()
    admit_fully(s, request("a", PROMPT), blocks(0, 5))
    b = request("b", PROMPT, skip_reading_prefix_cache=True)
    assert s.lookup(b, 0) == 0
    assert s.tiers[CPU].pinned_keys == 0
    assert s.lookups["b"].miss_reason is MissReason.PROMPT_LOGPROBS and s.lookups["b"].hit_tokens == 0


def test_discard_partial_chunks_also_stops_block_granular_tails():
    s = scheduler(discard_partial_chunks=True)
    _, plan = admit_fully(s, request("a", LONG[:700]), blocks(0, 6))  # a 188-token tail: one whole block
    assert [j.num_tokens for j in plan.stores] == [256, 256]


def test_a_skipped_tier_is_neither_looked_up_nor_written(tmp_path):
    s = scheduler(local_disk=str(tmp_path), max_local_disk_size=1)
    admit_fully(s, request("a", PROMPT), blocks(0, 5))
    for name in list(s.tiers[CPU].keys()):
        s.tiers[CPU].remove(name)
    s.on_worker_report(WorkerReport(tier_states={"disk": TierState.SKIPPED}))
    assert s.lookup(request("b", PROMPT), 0) == 0
    assert s.lookups["b"].miss_reason is MissReason.TIER_UNHEALTHY
    _, plan = admit_fully(s, request("c", list(range(7000, 7600))), blocks(10, 5))
    assert all(j.tiers == (CPU,) for j in plan.stores) and plan.stores
    assert {t.tier: t.health for t in s.sizes().tiers}["disk"] is TierState.SKIPPED
    s.shutdown()


class CountingTokens(list):
    read = 0

    def __getitem__(self, i):
        out = super().__getitem__(i)
        CountingTokens.read += len(out) if isinstance(i, slice) else 1
        return out


def test_decode_steps_read_no_prompt_tokens():
    s = scheduler(max_local_cpu_size=1.0)
    r = request("a", list(range(32768 // 2)))
    r.all_token_ids = CountingTokens(r.all_token_ids)
    admit_fully(s, r, blocks(0, 128))
    CountingTokens.read = 0
    for i in range(50):
        r.all_token_ids.append(i)
        r.num_tokens += 1
        s.build_plan(
            step(
                cached=[("a", [128 + i] if i % 128 == 0 else None, r.num_tokens - 1, False)],
                num_scheduled={"a": 1},
            )
        )
    assert CountingTokens.read == 0


def test_plans_are_ordered_lists_of_evictions_and_stores():
    s = scheduler(max_local_cpu_size=cpu_gb(2 * CHUNK))
    admit_fully(s, request("a", PROMPT[:512]), blocks(0, 4))
    _, plan = admit_fully(s, request("b", list(range(8000, 8512))), blocks(10, 4))
    kinds = [type(w).__name__ for w in plan.writes]
    assert kinds == ["Eviction", "StoreJob", "Eviction", "StoreJob"]
    assert all(isinstance(w, (Eviction, StoreJob)) for w in plan.writes)
