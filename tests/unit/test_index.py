from connector.engine.index import PinTable, TierIndex


def test_lru_eviction_within_budget():
    t = TierIndex("cpu", 300)
    assert t.admit("a", 100) == []
    assert t.admit("b", 100) == []
    assert t.admit("c", 100) == []
    t.touch("a")  # b is now least recently used
    assert t.admit("d", 100) == ["b"]
    assert set(t.keys()) == {"a", "c", "d"} and t.used_bytes == 300


def test_pinned_chunks_are_never_evicted():
    t = TierIndex("cpu", 200)
    t.admit("a", 100)
    t.admit("b", 100)
    assert t.pin("a")
    assert t.admit("c", 100) == ["b"]
    assert t.pin("c")
    assert t.admit("d", 100) is None  # everything is pinned: refuse, evict nothing
    assert set(t.keys()) == {"a", "c"}
    assert t.pinned_keys == 2 and t.pinned_bytes == 200


def test_too_big_chunk_is_refused():
    t = TierIndex("cpu", 100)
    assert t.admit("huge", 101) is None
    assert len(t) == 0


def test_pin_table_releases_exactly_once():
    t = TierIndex("cpu", 1000)
    t.admit("a", 10)
    pins = PinTable()
    pins.pin("r1", [(t, "a"), (t, "missing")])
    pins.pin("r2", [(t, "a")])
    assert t.pinned_keys == 1
    assert pins.release("r1") == 1
    assert pins.release("r1") == 0  # double release is a no-op
    assert t.pinned_keys == 1  # r2 still holds it
    pins.release("r2")
    assert t.pinned_keys == 0 and t.pinned_bytes == 0 and len(pins) == 0


def test_repinning_a_request_replaces_its_pins():
    t = TierIndex("cpu", 1000)
    t.admit("a", 10)
    t.admit("b", 10)
    pins = PinTable()
    pins.pin("r", [(t, "a")])
    pins.pin("r", [(t, "b")])
    assert t.admit("c", 990) == ["a"]  # a was unpinned by the second lookup


def test_add_known_then_overflow_evicts_lru_unpinned():
    t = TierIndex("disk", 250)
    t.admit("mine", 100)
    t.add_known("theirs1", 100)
    t.add_known("theirs2", 100)
    t.pin("theirs2")
    victims = t.overflow_victims()
    assert victims == ["theirs1"] and t.used_bytes == 200


def test_clear_keeps_pinned():
    t = TierIndex("cpu", 1000)
    t.admit("a", 10)
    t.admit("b", 10)
    t.pin("b")
    assert t.clear() == ["a"]
    assert t.keys() == ["b"]


def test_a_pin_on_a_forgotten_chunk_does_not_release_the_chunk_stored_again():
    """Found by test_engine_properties: r1's stale pin released r2's pin, and 'a' was evicted."""
    t = TierIndex("cpu", 100)
    pins = PinTable()
    t.admit("a", 60)
    pins.pin("r1", [(t, "a")])
    t.remove("a")  # a failed load, or another engine deleted the file
    t.admit("a", 60)  # a later request stores it again
    pins.pin("r2", [(t, "a")])
    pins.release("r1")
    assert t.pinned_keys == 1 and t.pinned_bytes == 60
    assert t.admit("b", 60) is None  # r2 still holds 'a'
