"""TierHealth: healthy -> failing -> skipped, and only a success or a probe brings it back."""

from connector.engine.health import TierHealth
from connector.engine.outcomes import FailureReason, TierState


def test_a_failure_reported_after_the_tier_was_skipped_keeps_it_skipped():
    # One timeout skips the tier; the write that was in flight then fails with an I/O error.
    # That says nothing new: the tier stays skipped until a probe or an operation succeeds.
    health = TierHealth("remote", clock=lambda: 0.0)
    health.failed(FailureReason.TIMEOUT, "a write has not finished")
    assert health.state is TierState.SKIPPED
    health.failed(FailureReason.IO_ERROR, "Connection reset")
    assert health.state is TierState.SKIPPED and not health.usable()
    health.succeeded()
    assert health.state is TierState.HEALTHY


def test_errors_in_a_row_skip_the_tier_and_a_probe_brings_it_back():
    now = [0.0]
    health = TierHealth("disk", failures_to_skip=3, first_backoff_s=1.0, clock=lambda: now[0])
    health.failed(FailureReason.MISSING)  # about one chunk, not the tier
    assert health.state is TierState.HEALTHY
    for expected in (TierState.FAILING, TierState.FAILING, TierState.SKIPPED):
        health.failed(FailureReason.IO_ERROR, "EIO")
        assert health.state is expected
    assert not health.probe_due()
    now[0] = 1.0
    assert health.probe_due() and not health.probe_due()  # one probe at a time
    health.probe_done(True)
    assert health.state is TierState.HEALTHY


def test_next_probe_in_s_follows_the_doubling_backoff():
    now = [0.0]
    health = TierHealth("disk", failures_to_skip=1, first_backoff_s=1.0, clock=lambda: now[0])
    assert health.next_probe_in_s() == 0.0  # healthy: nothing to wait for
    health.failed(FailureReason.IO_ERROR, "EIO")
    assert health.next_probe_in_s() == 1.0
    now[0] = 1.0
    assert health.next_probe_in_s() == 0.0 and health.probe_due()
    health.probe_done(False, "still EIO")  # the backoff doubles
    assert health.next_probe_in_s() == 2.0
    now[0] = 3.5
    assert health.next_probe_in_s() == 0.0
