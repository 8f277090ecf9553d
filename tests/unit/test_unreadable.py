from connector.engine.unreadable import UnreadableChunks

from .test_insight import Clock


def test_a_failed_chunk_is_unreadable_in_its_tier_only_and_only_for_a_while():
    clock = Clock()
    u = UnreadableChunks(ttl_s=10.0, clock=clock)
    u.add("remote", "a")
    assert u.unreadable("remote", "a") and not u.unreadable("cpu", "a") and not u.unreadable("remote", "b")
    clock.now += 9
    assert u.unreadable("remote", "a")
    clock.now += 2  # a recompute has stored a good copy meanwhile: offered again
    assert not u.unreadable("remote", "a") and not u.any_tier("a") and len(u) == 0


def test_the_memory_is_bounded_oldest_first():
    u = UnreadableChunks(max_chunks=3, clock=Clock())
    for name in "abcd":
        u.add("disk", name)
    assert len(u) == 3 and not u.unreadable("disk", "a") and u.unreadable("disk", "d")
    u.add("cpu", "d")  # the same chunk in two tiers
    assert u.unreadable("cpu", "d") and u.unreadable("disk", "d") and not u.any_tier("b")


def test_a_fresh_copy_makes_it_readable_again():
    u = UnreadableChunks(clock=Clock())
    u.add("cpu", "a")
    u.discard("cpu", "a")
    u.discard("disk", "a")  # never unreadable there: nothing to do
    assert not u.unreadable("cpu", "a") and len(u) == 0
