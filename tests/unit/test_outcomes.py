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
