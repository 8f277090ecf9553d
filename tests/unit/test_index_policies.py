"""Each ``cache_policy`` evicts in its own order, never a pinned key, in any case of its name."""

import random

import pytest

from connector.engine.eviction import FrequencyOrder, make_order
from connector.engine.index import TierIndex


def filled(policy: str, keys: str = "abcd", capacity: int = 400) -> TierIndex:
    t = TierIndex("cpu", capacity, policy=policy)
    for k in keys:
        assert t.admit(k, 100) == []
    return t


def test_lru_evicts_the_least_recently_used():
    t = filled("LRU")
    t.touch("a")
    t.touch("b")
    assert t.admit("e", 100) == ["c"]
    assert t.admit("f", 100) == ["d"]
    assert t.admit("g", 100) == ["a"]


def test_mru_evicts_the_most_recently_used():
    t = filled("MRU")
    t.touch("b")
    assert t.admit("e", 100) == ["b"]
    # nothing touched since: the newest stored chunk ("e") goes next
    assert t.admit("f", 100) == ["e"]
    t.touch("a")
    assert t.admit("g", 100) == ["a"]


def test_fifo_evicts_the_oldest_stored_whatever_was_used():
    t = filled("FIFO")
    for _ in range(5):
        t.touch("a")
    t.admit("b", 100)  # storing a held chunk again does not reorder either
    assert t.admit("e", 100) == ["a"]
    assert t.admit("f", 100) == ["b"]


def test_lfu_evicts_the_least_used_and_the_first_to_reach_that_count_among_ties():
    t = filled("LFU")
    t.touch("a")
    t.touch("a")
    t.touch("c")
    t.touch("b")  # b and c: 2 uses each, c got there first
    # d has 1 use (its store) and goes first
    assert t.admit("e", 100) == ["d"]
    # e is new (count 1): the least used now
    assert t.admit("f", 100) == ["e"]
    t.touch("f")
    t.touch("f")
    t.touch("f")
    assert t.admit("g", 100) == ["c"]
    assert t.admit("h", 100) == ["g"]
    assert t.keys() == ["h", "b", "a", "f"]


@pytest.mark.parametrize("policy", ["LRU", "LFU", "FIFO", "MRU"])
def test_every_policy_skips_pinned_keys_and_refuses_when_all_are_pinned(policy):
    t = filled(policy, "ab", capacity=200)
    first = t.keys()[0]
    other = t.keys()[1]
    assert t.pin(first)
    assert t.admit("c", 100) == [other]
    assert t.pin("c")
    assert t.admit("d", 100) is None
    assert sorted(t.keys()) == sorted([first, "c"]) and t.used_bytes == 200
    t.unpin(first)
    assert t.admit("d", 100) == [first]


@pytest.mark.parametrize("policy", ["LRU", "LFU", "FIFO", "MRU"])
def test_every_policy_keeps_bytes_and_pins_consistent_under_random_operations(policy):
    rng = random.Random(policy)
    t = TierIndex("cpu", 1000, policy=policy)
    for _ in range(3000):
        key = f"k{rng.randrange(40)}"
        op = rng.random()
        if op < 0.4:
            t.admit(key, rng.choice((50, 100, 150)))
        elif op < 0.6:
            t.touch(key)
        elif op < 0.7:
            t.pin(key)
        elif op < 0.8:
            t.unpin(key)
        elif op < 0.9:
            t.remove(key)
        else:
            t.add_known(key, 100, most_recent=rng.random() < 0.5)
            t.overflow_victims()
        keys = t.keys()
        assert len(keys) == len(set(keys)) == len(t)
        assert t.used_bytes == sum(t._entries[k].nbytes for k in keys)
        assert t.pinned_bytes == sum(t._entries[k].nbytes for k in keys if t._entries[k].pins)


@pytest.mark.parametrize("name", ["lru", "Lfu", "fifo", "mRu", "LRU"])
def test_policy_names_are_read_in_any_case(name):
    assert TierIndex("cpu", 10, policy=name).policy == name.upper()


def test_an_unknown_policy_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="LRU, LFU, FIFO, MRU"):
        make_order("ARC")


@pytest.mark.parametrize("policy", ["LRU", "LFU", "FIFO", "MRU"])
def test_add_known_old_keys_go_first_and_recent_ones_rank_as_just_stored(policy):
    t = filled(policy, "ab", capacity=400)
    t.add_known("old", 100, most_recent=False)
    t.add_known("new", 100, most_recent=True)
    first = "new" if policy == "MRU" else "old"
    assert t.keys()[0] == first
    assert t.overflow_victims() == []
    t.capacity_bytes = 300
    assert t.overflow_victims() == [first] and len(t) == 3


def test_lfu_counts_start_at_one_and_leave_with_the_key():
    order = FrequencyOrder()
    order.add("a")
    order.use("a")
    order.use("a")
    assert order.count("a") == 3
    order.discard("a")
    assert order.count("a") == 0 and list(order.candidates()) == []
    order.add("a")
    assert order.count("a") == 1
