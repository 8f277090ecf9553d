"""A failed load deletes only what was found damaged or missing (issue 26, item 9).

A timeout, a stalled copy or a tier error says nothing about the chunk's bytes: it is a miss,
counted with its reason, and the chunk and the later chunks of its prefix stay indexed and
stored. The failed chunk is passed over by lookups for a while in that tier, so vLLM's
immediate second look-up after a failed asynchronous load does not load it again at once.
"""

import pytest

from connector.config.loading import load_config
from connector.engine.jobs import CPU
from connector.engine.outcomes import FailureReason, TierState, WorkerReport
from connector.scheduler.connector_scheduler import ConnectorScheduler

from .fakes import admit_fully, blocks, facts, request
from .test_insight import Clock
from .test_scheduler import PROMPT, loaded

KEEPS = [FailureReason.TIMEOUT, FailureReason.IO_ERROR, FailureReason.TIER_UNHEALTHY]


def _scheduler(clock: Clock) -> ConnectorScheduler:
    return ConnectorScheduler(load_config({}, env={}), facts(), clock)


def _failed_load(s: ConnectorScheduler, reason: FailureReason) -> list[str]:
    """``a`` stores two chunks; ``b``'s load of them fails at the first one with ``reason``."""
    admit_fully(s, request("a", PROMPT), blocks(0, 5))
    s.finish(request("a", PROMPT))
    s.state.take_pending_evictions()
    _, plan = admit_fully(s, request("b", PROMPT), blocks(10, 5))
    (job,) = plan.loads
    s.on_worker_report(WorkerReport(loads={"b": loaded(job, fail_at=0, reason=reason)}))
    return [c.name for c in job.chunks]


def _evictions(s: ConnectorScheduler) -> list[str]:
    return [e.name for e in s.state.take_pending_evictions()]


@pytest.mark.parametrize("reason", KEEPS, ids=lambda r: r.value)
def test_a_slow_or_failing_read_keeps_the_chunk_and_the_rest_of_its_prefix(reason):
    clock = Clock()
    s = _scheduler(clock)
    names = _failed_load(s, reason)
    assert all(name in s.tiers[CPU] for name in names)
    assert _evictions(s) == []  # nothing deleted from the tier


@pytest.mark.parametrize("reason", [FailureReason.TIMEOUT, FailureReason.IO_ERROR], ids=lambda r: r.value)
def test_a_timed_out_chunk_is_passed_over_briefly_then_offered_again(reason):
    clock = Clock()
    s = _scheduler(clock)
    _failed_load(s, reason)
    assert s.lookup(request("c", PROMPT), 0) == 0  # vLLM's look-up right after: no load loop
    s.finish(request("c", PROMPT))
    clock.now += 11  # past the pass-over: the kept chunks serve again
    assert s.lookup(request("d", PROMPT), 0) == 512


@pytest.mark.parametrize("reason", [FailureReason.CORRUPT, FailureReason.MISSING], ids=lambda r: r.value)
def test_a_damaged_or_missing_chunk_is_forgotten_with_the_rest_of_its_prefix(reason):
    s = _scheduler(Clock())
    names = _failed_load(s, reason)
    assert all(name not in s.tiers[CPU] for name in names)
    assert sorted(_evictions(s)) == sorted(names)


def test_a_tier_back_from_being_skipped_offers_its_kept_chunks_at_once():
    """A read that failed on a broken tier kept its chunk; once a probe finds the tier working
    again, that chunk is offered again at once (a load then finds what is really there), not
    passed over for the rest of the pass-over."""
    clock = Clock()
    s = _scheduler(clock)
    _failed_load(s, FailureReason.IO_ERROR)
    s.on_worker_report(WorkerReport(tier_states={CPU: TierState.SKIPPED}))
    s.on_worker_report(WorkerReport(tier_states={CPU: TierState.HEALTHY}))
    assert s.lookup(request("c", PROMPT), 0) == 512
