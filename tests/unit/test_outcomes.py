from connector.engine.jobs import ChunkLoad
from connector.engine.outcomes import (
    ChunkLoadResult,
    FailureReason,
    LoadOutcome,
    TierState,
    WorkerReport,
)


def outcome(*chunks, failed=()):
    return LoadOutcome("r", [ChunkLoadResult(*c) for c in chunks], list(failed), 100, 0.01)


def test_ranks_that_fell_back_to_different_tiers_count_each_token_once():
    rank0 = outcome(("a", "cpu", 256, "cpu"), ("b", "cpu", 256, "cpu"))
    rank1 = outcome(("a", "cpu", 256, "cpu"), ("b", "cpu", 256, "disk", FailureReason.MISSING))
    rank0.merge(rank1)
    assert rank0.tokens_by_tier() == {"cpu": 256, "disk": 256}
    assert rank0.chunks[1].reason is FailureReason.MISSING  # the cpu copy leaves the index
    assert rank0.nbytes == 200 and rank0.seconds == 0.01


def test_a_chunk_that_failed_on_one_rank_failed():
    rank0 = outcome(("a", "disk", 256, "disk"))
    rank1 = outcome(("a", "disk", 256, None, FailureReason.CORRUPT), failed=[4, 5])
    rank0.merge(rank1)
    assert not rank0.chunks[0].ok and rank0.chunks[0].reason is FailureReason.CORRUPT
    assert rank0.failed_block_ids == [4, 5] and rank0.tokens_by_tier() == {}


def test_reports_merge_states_worst_first_and_pending_by_the_busiest_rank():
    a = WorkerReport(tier_states={"disk": TierState.FAILING}, pending_writes=3)
    b = WorkerReport(tier_states={"disk": TierState.SKIPPED}, pending_writes=1)
    a.merge(b)
    assert a.tier_states == {"disk": TierState.SKIPPED} and a.pending_writes == 3


def test_every_rank_falling_back_counts_the_fallback_tier_once():
    rank0 = outcome(("a", "cpu", 512, "cpu"))
    rank1 = outcome(("a", "cpu", 512, "disk", FailureReason.MISSING))
    rank0.merge(rank1)
    assert rank0.tokens_by_tier() == {"disk": 512}


def test_a_rank_that_abandoned_its_load_before_starting_merges_as_not_loaded():
    """TP plus a client abort: one rank's cancelled load lists no chunks, another's lists all.
    The merge runs inside vLLM's output aggregation: it must never raise."""
    started = outcome(("a", "disk", 256, "disk"), ("b", "disk", 256, "disk"))
    started.cancelled = True
    abandoned = LoadOutcome("r", cancelled=True)
    report = WorkerReport(loads={"r": started})
    report.merge(WorkerReport(loads={"r": abandoned}))
    merged = report.loads["r"]
    assert [c.name for c in merged.chunks] == ["a", "b"]
    assert merged.tokens_by_tier() == {} and merged.failures() == []  # not loaded, nothing to forget
    assert merged.rank_disagreements == 1 and merged.cancelled and merged.ranks == 2


def test_the_other_order_and_chunks_one_rank_lists_alone_are_not_loaded_either():
    abandoned = LoadOutcome("r", cancelled=True)
    started = outcome(("a", "disk", 256, "disk"), ("b", "disk", 256, None, FailureReason.CORRUPT))
    assert abandoned.merge(started) is True
    assert [(c.name, c.tier, c.reason) for c in abandoned.chunks] == [
        ("a", None, None),
        ("b", None, FailureReason.CORRUPT),
    ]
    assert abandoned.rank_disagreements == 1


def test_an_outcome_not_started_lists_every_chunk_so_ranks_agree():
    chunks = [ChunkLoad(n, "disk", (1, 2), 0, 256) for n in ("a", "b")]
    none = LoadOutcome.not_started("r", chunks)
    started = outcome(("a", "disk", 256, "disk"), ("b", "disk", 256, "disk"))
    assert started.merge(none) is False
    assert started.rank_disagreements == 0 and started.tokens_by_tier() == {}
