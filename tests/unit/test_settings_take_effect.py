"""Settings accepted at start-up change what the scheduler half does (not only pass validation)."""

import pytest

from .fakes import BLOCK_BYTES, LAYERS, admit_fully, blocks, cpu_gb, request, scheduler

CHUNK = 2 * BLOCK_BYTES * LAYERS


def test_tag_keys_turn_request_parameters_into_key_tags():
    s = scheduler(extra_config={"tag_keys": ["user"]})

    def namespace(rid, params):
        return s.prefix.policy(request(rid, [1, 2, 3], kv_transfer_params=params)).namespace

    alice = namespace("a", {"user": "alice"})
    assert alice == namespace("b", {"lmcache.tag.user": "alice"})
    assert alice != namespace("c", {"user": "bob"}) and alice != namespace("d", None)
    prompt = list(range(5000, 5600))
    admit_fully(s, request("e", prompt, kv_transfer_params={"user": "alice"}), blocks(0, 5))
    assert s.lookup(request("f", prompt, kv_transfer_params={"user": "bob"}), 0) == 0
    assert s.lookup(request("g", prompt, kv_transfer_params={"user": "alice"}), 0) == 512


def test_cache_policy_chooses_what_the_tiers_evict():
    prompts = [list(range(p * 1000, p * 1000 + 256)) for p in range(4)]  # one chunk each

    def survivors(policy):
        s = scheduler(max_local_cpu_size=cpu_gb(3 * CHUNK), cache_policy=policy)
        for i in (0, 1, 2):
            admit_fully(s, request(f"w{i}", prompts[i] + [9]), blocks(0, 3))
        for k in range(3):  # prompt 0 is loaded again and again: the most frequently used
            reader = request(f"r{k}", prompts[0] + [9])
            admit_fully(s, reader, blocks(10, 3))
            s.finish(reader)
        admit_fully(s, request("w3", prompts[3] + [9]), blocks(0, 3))  # one must go
        return [bool(s.lookup(request(f"q{i}", prompts[i] + [9]), 0)) for i in range(4)]

    assert survivors("LRU") == [True, False, True, True]  # the least recently used went
    assert survivors("lfu") == [True, False, True, True]
    assert survivors("FIFO") == [False, True, True, True]  # the first stored went, read or not
    assert survivors("MRU") == [False, True, True, True]  # the most recently used went


def test_a_tier_measured_slower_than_recompute_is_not_loaded_from():
    from connector.engine.jobs import CPU

    from .test_insight import Clock

    prompt = list(range(4000, 4600))

    def looked_up(**extra):
        s = scheduler(**extra)
        clock = Clock()
        s.state.tier_speeds._clock = clock
        admit_fully(s, request("a", prompt), blocks(0, 5))
        s.prefix.compute_cost = lambda: 1e-6  # a token computes in 1 us
        for _ in range(2):  # two loads measured at 1 ms per chunk: 4 us a token
            s.state.tier_speeds.observe(CPU, 2 * BLOCK_BYTES * LAYERS, 1e-3)
        return s, s.lookup(request("b", prompt), 0), clock

    s, need, clock = looked_up()
    assert need == 0  # loading 512 tokens would take 2 ms, computing them 0.5 ms
    result = s.lookups["b"]
    assert result.miss_reason.value == "slower_than_recompute" and result.miss_detail["tier"] == CPU
    assert result.miss_detail["load_ms"] > result.miss_detail["compute_ms"]
    clock.now += 11  # once in a while the tier is loaded from anyway, to measure it again
    assert s.lookup(request("c", prompt), 0) == 512
    off, need, _ = looked_up(extra_config={"load_only_if_faster": False})
    assert need == 512


def test_a_slow_tier_that_got_fast_is_loaded_from_again_after_one_recheck():
    from connector.engine.load_speed import TierSpeeds

    from .test_insight import Clock

    clock = Clock()
    speeds = TierSpeeds(clock=clock)
    for _ in range(20):  # a long slow spell: 1 s per MB
        speeds.observe("remote", 1e6, 1.0)
    assert speeds.seconds("remote", 1e6) == pytest.approx(1.0)
    assert not speeds.recheck("remote")  # judged slow: not loaded from for recheck_s
    clock.now += 11
    assert speeds.recheck("remote")  # loaded from anyway, and the tier is fast again
    speeds.observe("remote", 1e6, 0.001)
    assert speeds.seconds("remote", 1e6) == pytest.approx(0.001)  # the recheck is the new truth
    speeds.observe("remote", 1e6, 0.003)  # later loads average from there
    assert 0.001 < speeds.seconds("remote", 1e6) < 0.003
