"""The tail directory: which unfull chunks are stored after each parent, so a lookup that misses
a whole chunk hashes only the block prefixes some stored chunk could match."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connector.config.loading import load_config
from connector.engine.facts import EngineFacts
from connector.engine.jobs import CPU
from connector.engine.keys import block_prefixes
from connector.engine.tails import TailDirectory
from connector.scheduler.connector_scheduler import ConnectorScheduler

from .fakes import admit_fully, request, scheduler

P, Q = bytes(16), bytes([1] * 16)


def test_the_directory_counts_each_stored_length_until_its_last_chunk_leaves():
    tails = TailDirectory()
    tails.add(P, 32, "a")
    tails.add(P, 32, "b")  # other tokens, same parent and length
    tails.add(P, 16, "c")
    tails.add(P, 16, "c")  # stored again: still one
    tails.add(Q, 48, "d")
    assert tails.lengths(P) == [32, 16] and tails.lengths(Q) == [48] and len(tails) == 4
    tails.discard("a")
    tails.discard("c")
    tails.discard("never stored")
    assert tails.lengths(P) == [32]
    tails.discard("b")
    tails.discard("d")
    assert tails.lengths(P) == tails.lengths(Q) == [] and len(tails) == 0


def test_the_directory_hashes_only_stored_lengths_and_gives_block_prefix_keys():
    tails = TailDirectory()
    chunk = list(range(100, 160))
    for length, name in ((48, "x"), (32, "y"), (20, "unaligned"), (64, "longer than the chunk")):
        tails.add(P, length, name)
    every = dict(block_prefixes(P, chunk, 64, 16))
    assert list(tails.prefixes(P, chunk, 64, 16)) == [(48, every[48]), (32, every[32])]
    assert list(tails.prefixes(P, chunk[:40], 64, 16)) == [(32, every[32])]
    assert list(tails.prefixes(Q, chunk, 64, 16)) == []


def test_only_a_cpu_only_engine_keeps_a_directory(tmp_path):
    assert scheduler().tails is not None
    assert (
        scheduler(local_disk=str(tmp_path), max_local_disk_size=1).tails is None
    )  # other engines write there
    assert scheduler(remote_url="redis://localhost:1").tails is None


def test_an_evicted_or_reset_tail_leaves_the_directory():
    s = scheduler()
    admit_fully(s, request("a", list(range(700))), list(range(6)))  # two chunks, a one-block tail
    assert len(s.tails) == 1
    s.reset()
    assert len(s.tails) == 0 and len(s.tiers[CPU]) == 0


SHARED = list(range(5000, 5300))


def tiny_engine(save_unfull_chunk: bool) -> ConnectorScheduler:
    """16-token blocks, 64-token chunks, room for six chunks: tails of three lengths, evictions."""
    facts = EngineFacts("m", "bf16", 16, 1, 1000, "layout", 1, "kv_both")
    budget = 6 * facts.chunk_nbytes(64) / 1024**3
    config = {"chunk_size": 64, "max_local_cpu_size": budget, "save_unfull_chunk": save_unfull_chunk}
    return ConnectorScheduler(load_config({f"lmcache.{k}": v for k, v in config.items()}, env={}), facts)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(0, 300), st.lists(st.integers(0, 2), max_size=40)), max_size=12),
    st.booleans(),
)
def test_lookups_with_the_directory_find_what_probing_every_prefix_finds(prompts, save_unfull_chunk):
    """Prompts that share prefixes cut at every length: hits, stores and evictions agree (with
    and without exact unfull chunks stored)."""
    fast, every = tiny_engine(save_unfull_chunk), tiny_engine(save_unfull_chunk)
    every.tails = None  # probes every whole-block prefix
    for i, (cut, rest) in enumerate(prompts):
        tokens = SHARED[:cut] + rest
        if not tokens:
            continue
        for s in (fast, every):
            req = request(f"r{i}", tokens)
            need, _ = admit_fully(s, req, list(range(-(-len(tokens) // 16))))
            s.finish(req)
            s.take_done()
        assert fast.lookups == every.lookups == {}
        assert fast.tiers[CPU].keys() == every.tiers[CPU].keys()
        probe = request(f"p{i}", tokens)
        assert fast.lookup(probe, 0) == every.lookup(probe, 0)
        assert fast.lookups[probe.request_id].hits == every.lookups[probe.request_id].hits
        for s in (fast, every):
            s.finish(probe)
    assert len(fast.tails) <= len(fast.tiers[CPU])
