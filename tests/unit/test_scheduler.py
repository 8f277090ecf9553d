from connector.engine.jobs import CPU, DISK
from connector.engine.outcomes import ChunkLoadResult, FailureReason, LoadOutcome, MissReason, WorkerReport

from .fakes import BLOCK_BYTES, LAYERS, admit_fully, blocks, cpu_gb, request, scheduler, step

PROMPT = list(range(1000, 1600))  # 600 tokens: two full chunks and an 88-token tail


def loaded(job, fail_at=None, reason=FailureReason.CORRUPT) -> LoadOutcome:
    """The worker's outcome of a load job: every chunk loaded, or chunks from ``fail_at`` failed."""
    out = LoadOutcome(job.request_id)
    for i, c in enumerate(job.chunks):
        r = ChunkLoadResult(c.name, c.tier, c.num_tokens)
        if fail_at is None or i < fail_at:
            r.tier = c.tier
        else:
            r.reason = reason if i == fail_at else FailureReason.PREFIX_FAILED
            out.failed_block_ids.extend(c.block_ids)
        out.chunks.append(r)
    return out


def test_cold_request_stores_whole_chunks_only():
    s = scheduler()
    need, plan = admit_fully(s, request("a", PROMPT), blocks(10, 5))
    assert need == 0 and not plan.loads
    assert [(j.block_ids, j.num_tokens, j.tiers) for j in plan.stores] == [
        ((10, 11), 256, (CPU,)),
        ((12, 13), 256, (CPU,)),
    ]
    assert s.tiers[CPU].used_bytes == 2 * 2 * BLOCK_BYTES * LAYERS


def test_shared_prefix_is_loaded_into_the_new_requests_blocks():
    s = scheduler()
    admit_fully(s, request("a", PROMPT), blocks(10, 5))
    s.finish(request("a", PROMPT))
    b = request("b", PROMPT[:512] + [7] * 50)
    need, plan = admit_fully(s, b, blocks(40, 5))
    assert need == 512
    (job,) = plan.loads
    assert [(c.block_ids, c.first_block, c.num_tokens) for c in job.chunks] == [
        ((40, 41), 0, 256),
        ((42, 43), 0, 256),
    ]
    assert not plan.stores  # its chunks are already stored
    assert s.finish(b).params["num_lmcache_cached_tokens"] == 512


def test_full_prompt_hit_leaves_the_last_token_to_compute():
    s = scheduler()
    prompt = PROMPT[:512]
    admit_fully(s, request("a", prompt), blocks(0, 4))
    need, plan = admit_fully(s, request("b", prompt), blocks(20, 4))
    assert need == 511
    assert sum(c.num_tokens for c in plan.loads[0].chunks) == 511
    assert plan.loads[0].chunks[-1].block_ids == (22, 23)


def test_blocks_vllm_already_has_are_not_written():
    s = scheduler()
    admit_fully(s, request("a", PROMPT), blocks(0, 5))
    need, plan = admit_fully(s, request("b", PROMPT), blocks(0, 1) + blocks(30, 4), local_hit=128)
    assert need == 512 - 128
    chunks = plan.loads[0].chunks
    assert [(c.block_ids, c.first_block) for c in chunks] == [((30,), 1), ((31, 32), 0)]


def test_below_min_retrieve_loads_nothing_and_does_not_store_again():
    s = scheduler(min_retrieve_tokens=300)
    admit_fully(s, request("a", PROMPT[:300]), blocks(0, 3))  # stores chunk 0 only
    b = request("b", PROMPT)
    need, plan = admit_fully(s, b, blocks(10, 5))
    assert need == 0 and not plan.loads
    assert s.trackers["b"].miss_reason == MissReason.BELOW_MIN_RETRIEVE
    assert [j.num_tokens for j in plan.stores] == [256]  # only chunk 1; chunk 0 was a hit
    assert plan.stores[0].block_ids == (12, 13)


def test_partial_chunk_saved_only_with_save_unfull_chunk_and_hit_by_the_same_prompt():
    s = scheduler()
    _, plan = admit_fully(s, request("a", PROMPT), blocks(0, 5))
    assert all(j.num_tokens == 256 for j in plan.stores)
    s = scheduler(save_unfull_chunk=True)
    _, plan = admit_fully(s, request("a", PROMPT), blocks(0, 5))
    assert [j.num_tokens for j in plan.stores] == [256, 256, 88]
    assert plan.stores[-1].block_ids == (4,)
    need, _ = admit_fully(s, request("b", PROMPT), blocks(10, 5))
    assert need == 599


def test_discard_partial_chunks_wins_over_save_unfull_chunk():
    s = scheduler(save_unfull_chunk=True, discard_partial_chunks=True)
    _, plan = admit_fully(s, request("a", PROMPT), blocks(0, 5))
    assert [j.num_tokens for j in plan.stores] == [256, 256]


def test_chunked_prefill_stores_each_chunk_once_it_is_complete():
    s = scheduler(save_unfull_chunk=True)
    r = request("a", PROMPT)
    s.lookup(r, 0)
    s.after_alloc(r, 0)
    p1 = s.build_plan(step(new=[(r, blocks(0, 4), 0)], num_scheduled={"a": 400}))
    assert [j.num_tokens for j in p1.stores] == [256]
    p2 = s.build_plan(step(cached=[("a", blocks(4, 1), 400, False)], num_scheduled={"a": 200}))
    assert [(j.block_ids, j.num_tokens) for j in p2.stores] == [((2, 3), 256), ((4,), 88)]
    r.all_token_ids.append(5)  # decode: nothing more is stored without save_decode_cache
    p3 = s.build_plan(step(cached=[("a", None, 600, False)], num_scheduled={"a": 1}))
    assert not p3.stores


def test_save_decode_cache_stores_chunks_filled_by_generated_tokens():
    s = scheduler(save_decode_cache=True)
    r = request("a", PROMPT[:500])
    admit_fully(s, r, blocks(0, 4))
    r.all_token_ids += list(range(20))
    r.num_tokens = len(r.all_token_ids)
    plan = s.build_plan(step(cached=[("a", None, 510, False)], num_scheduled={"a": 10}))
    assert [(j.block_ids, j.num_tokens) for j in plan.stores] == [((2, 3), 256)]


def test_roles_producer_never_loads_consumer_never_stores():
    producer = scheduler("kv_producer")
    _, plan = admit_fully(producer, request("a", PROMPT), blocks(0, 5))
    assert len(plan.stores) == 2
    assert producer.lookup(request("b", PROMPT), 0) == 0
    consumer = scheduler("kv_consumer")
    _, plan = admit_fully(consumer, request("a", PROMPT), blocks(0, 5))
    assert not plan.stores


def test_request_params_skip_save_priority_and_invalid_tags():
    s = scheduler(priority_limit=5)
    _, plan = admit_fully(
        s, request("a", PROMPT, kv_transfer_params={"lmcache.skip_save": True}), blocks(0, 5)
    )
    assert not plan.stores
    _, plan = admit_fully(s, request("b", PROMPT, priority=9), blocks(0, 5))
    assert not plan.stores
    _, plan = admit_fully(
        s, request("c", PROMPT, kv_transfer_params={"lmcache.tag.user": ["x"]}), blocks(0, 5)
    )
    assert not plan.stores and not plan.loads  # a bad tag: served without KVLens, not crashed
    _, plan = admit_fully(
        s, request("d", PROMPT, kv_transfer_params={"lmcache.skip_save": "maybe"}), blocks(0, 5)
    )
    assert not plan.stores


def test_cache_salt_and_tags_isolate_tenants():
    s = scheduler()
    admit_fully(s, request("a", PROMPT, cache_salt="tenant-1"), blocks(0, 5))
    assert s.lookup(request("b", PROMPT, cache_salt="tenant-2"), 0) == 0
    assert s.lookup(request("c", PROMPT), 0) == 0
    assert s.lookup(request("d", PROMPT, cache_salt="tenant-1"), 0) == 512
    admit_fully(s, request("e", PROMPT, kv_transfer_params={"lmcache.tag.user": "x"}), blocks(0, 5))
    assert s.lookup(request("f", PROMPT, kv_transfer_params={"lmcache.tag.user": "y"}), 0) == 0


def test_pins_hold_from_lookup_until_the_load_is_reported():
    s = scheduler(max_local_cpu_size=cpu_gb(2 * 2 * BLOCK_BYTES * LAYERS))  # room for 2 chunks
    admit_fully(s, request("a", PROMPT), blocks(0, 5))
    b = request("b", PROMPT)
    assert s.lookup(b, 0) == 512
    assert s.tiers[CPU].pinned_keys == 2
    s.after_alloc(b, 512)
    # Another prompt needs room: the pinned chunks must survive.
    _, plan = admit_fully(s, request("c", list(range(5000, 5600))), blocks(50, 5))
    assert not plan.stores and not plan.evictions
    plan_b = s.build_plan(step(new=[(b, blocks(10, 5), 512)], num_scheduled={"b": 88}))
    s.on_worker_report(WorkerReport(loads={"b": loaded(plan_b.loads[0])}))
    assert s.tiers[CPU].pinned_keys == 0 and len(s.pins) == 0
    _, plan = admit_fully(s, request("d", list(range(5000, 5600))), blocks(60, 5))
    assert len(plan.stores) == 2 and len(plan.evictions) == 2


def test_abort_after_lookup_releases_pins():
    s = scheduler()
    admit_fully(s, request("a", PROMPT), blocks(0, 5))
    b = request("b", PROMPT)
    s.lookup(b, 0)
    assert s.tiers[CPU].pinned_keys == 2
    s.finish(b)
    assert s.tiers[CPU].pinned_keys == 0
    assert s.sizes().request_trackers == 1 and not s.lookups and len(s.pins) == 0


def test_failed_load_drops_chunk_and_rollback_stores_it_again():
    s = scheduler()
    admit_fully(s, request("a", PROMPT), blocks(0, 5))
    b = request("b", PROMPT)
    need, plan = admit_fully(s, b, blocks(10, 5))
    second = plan.loads[0].chunks[1]
    s.on_worker_report(WorkerReport(loads={"b": loaded(plan.loads[0], fail_at=1)}))
    assert second.name not in s.tiers[CPU]
    # vLLM rolls b back to the first failed block and recomputes from there.
    plan = s.build_plan(step(cached=[("b", None, 256, False)], num_scheduled={"b": 344}))
    assert [(j.name, j.block_ids) for j in plan.stores] == [(second.name, (12, 13))]
    r = request("c", PROMPT)
    assert s.lookup(r, 0) == 512


def test_preempted_request_resumes_with_new_blocks_and_reloads():
    s = scheduler()
    r = request("a", PROMPT)
    admit_fully(s, r, blocks(0, 5))
    r.all_token_ids += [1, 2, 3]
    r.num_tokens = len(r.all_token_ids)
    s.build_plan(step(cached=[("a", None, 600, False)], num_scheduled={"a": 1}))
    # Preempted: vLLM freed its blocks; on resume it looks up again and gets new blocks.
    need = s.lookup(r, 0)
    assert need == 512
    s.after_alloc(r, need)
    plan = s.build_plan(step(cached=[("a", blocks(70, 5), 512, True)], num_scheduled={"a": 91}))
    assert [c.block_ids for c in plan.loads[0].chunks] == [(70, 71), (72, 73)]
    assert s.trackers["a"].block_ids == blocks(70, 5) and s.trackers["a"].computed == 603


def test_miss_reasons_tell_evicted_from_never_stored():
    s = scheduler(max_local_cpu_size=cpu_gb(2 * BLOCK_BYTES * LAYERS))  # one chunk
    admit_fully(s, request("a", PROMPT[:256] + [1]), blocks(0, 3))
    admit_fully(s, request("b", list(range(7000, 7257))), blocks(10, 3))  # evicts a's chunk
    s.lookup(request("c", PROMPT), 0)
    assert s.lookups["c"].miss_reason == MissReason.EVICTED
    s.lookup(request("d", list(range(9000, 9600))), 0)
    assert s.lookups["d"].miss_reason == MissReason.NOT_STORED


def test_writes_go_to_every_tier_and_lookups_prefer_cpu(tmp_path):
    s = scheduler(local_disk=str(tmp_path), max_local_disk_size=1)
    _, plan = admit_fully(s, request("a", PROMPT), blocks(0, 5))
    assert all(j.tiers == (CPU, DISK) for j in plan.stores)
    s.tiers[CPU].remove(plan.stores[1].name)
    b = request("b", PROMPT)
    assert s.lookup(b, 128) == 512 - 128
    s.after_alloc(b, 512 - 128)
    assert s.external_tokens_by_tier("b", 512 - 128) == {CPU: 128, DISK: 256}  # vLLM had 128
    c = request("c", PROMPT)
    s.after_alloc(c, s.lookup(c, 0), blocks(10, 5))  # a disk chunk: the load runs outside the step
    (job,) = [j for j in s.build_plan(step()).async_loads if j.request_id == "c"]
    assert [c.tier for c in job.chunks] == [CPU, DISK]
    s.shutdown()


def test_cache_usage_details_can_be_turned_off():
    s = scheduler(extra_config={"enable_cache_usage_details_in_response": False})
    admit_fully(s, request("a", PROMPT), blocks(0, 5))
    assert s.finish(request("a", PROMPT)).params is None


def test_reset_forgets_unpinned_chunks_and_tells_workers():
    s = scheduler()
    admit_fully(s, request("a", PROMPT), blocks(0, 5))
    s.reset()
    plan = s.build_plan(step())
    assert len(plan.evictions) == 2
    assert s.lookup(request("b", PROMPT), 0) == 0


def test_multimodal_embeds_and_dp_padding_requests_bypass_kvlens():
    s = scheduler()
    admit_fully(s, request("a", PROMPT), blocks(0, 5))
    for r in (
        request("mm", PROMPT, mm_features=[object()]),
        request("emb", PROMPT, prompt_embeds=object()),
        request("mock_req_0", PROMPT),
    ):
        need, plan = admit_fully(s, r, blocks(10, 5))
        assert need == 0 and not plan.loads and not plan.stores


LONG = list(range(2000, 2700))  # 700 tokens: two chunks, then a 188-token tail (one whole block)


def test_unfull_tail_is_stored_as_whole_blocks_and_shared_by_longer_prompts():
    s = scheduler()
    _, plan = admit_fully(s, request("a", LONG), blocks(0, 6))
    assert [(j.block_ids, j.num_tokens) for j in plan.stores] == [((0, 1), 256), ((2, 3), 256), ((4,), 128)]
    assert s.lookup(request("same", LONG), 0) == 640
    longer = request("longer", LONG + list(range(300)))
    assert s.lookup(longer, 0) == 640
    s.after_alloc(longer, 640)
    plan = s.build_plan(step(new=[(longer, blocks(20, 8), 640)], num_scheduled={"longer": 360}))
    assert [(c.block_ids, c.num_tokens) for c in plan.loads[0].chunks] == [
        ((20, 21), 256),
        ((22, 23), 256),
        ((24,), 128),
    ]
    # Its own full third chunk and its 232-token tail cut to one block are stored.
    assert [(j.block_ids, j.num_tokens) for j in plan.stores] == [((24, 25), 256), ((26,), 128)]


def test_block_granular_tails_can_be_turned_off():
    s = scheduler(extra_config={"block_granular_tails": False})
    _, plan = admit_fully(s, request("a", LONG), blocks(0, 6))
    assert [j.num_tokens for j in plan.stores] == [256, 256]
    assert s.lookup(request("b", LONG), 0) == 512


def test_exact_unfull_tail_and_its_block_cut_are_both_stored():
    s = scheduler(save_unfull_chunk=True)
    _, plan = admit_fully(s, request("a", LONG), blocks(0, 6))
    assert [(j.block_ids, j.num_tokens) for j in plan.stores][2:] == [((4,), 128), ((4, 5), 188)]
    assert s.lookup(request("b", LONG), 0) == 699
    assert s.lookup(request("c", LONG[:650]), 0) == 640
