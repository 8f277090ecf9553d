"""The worker's report to the scheduler: loads, stores landed or failed, kept and deleted chunks,
tier health changes and pending writes since the last one; and the remote tier's calls.
"""

from __future__ import annotations

from ..engine.jobs import REMOTE
from ..engine.keys import storage_name
from ..engine.outcomes import FailureReason, KeptChunk, RemoteCall, StoreFailure, WorkerReport
from ..tiers.background import BackgroundTier
from .worker_state import WorkerState
from .writes import Writes


class Reports:
    """Builds each step's report from the state and the background tiers."""

    def __init__(self, state: WorkerState, writes: Writes) -> None:
        self.state = state
        self.writes = writes
        self._reported_pending = 0  # the pending-write count the scheduler last heard
        self._suffix = storage_name("", state.rank)

    def take(self) -> WorkerReport | None:
        self.writes.write_ready()  # stores a device has copied out since
        report = self.state.report
        for tier in self.state.background:
            if tier.stuck():
                tier.health.failed(FailureReason.TIMEOUT, "a write has not finished")
        # The count before what landed: a write landing in between is in both, never in neither.
        # A skipped tier's queue counts too: its writes' outcomes are still to be reported.
        pending = sum(t.pending for t in self.state.background)
        pending += sum(len(q.plan.stores) for q in self.state.unwritten) + len(self.state.deps)
        for tier in self.state.background:
            traffic = tier.take_traffic(self.state.counts_chunks)
            if not traffic.is_empty():
                report.tier_traffic(tier.name).merge(traffic)
            for name, reason, detail in tier.take_failures():
                report.store_failures.append(StoreFailure("", self._digest(name), tier.name, reason, detail))
            for name, nbytes in tier.take_kept():
                report.kept.append(KeptChunk(tier.name, self._digest(name), nbytes))
            deleted = tier.take_deleted()
            if self.state.rank == 0:  # one rank's files stand for the chunk: counted once
                report.deleted.extend((tier.name, self._digest(name)) for name in deleted)
        self._probe_skipped_tiers()
        for name, health in self.state.health.items():
            change = health.take_change()
            if change is not None:
                report.tier_states[name] = change
        if pending or pending != self._reported_pending:  # while any, and the drop to 0: draining stops
            report.pending_writes = self._reported_pending = pending
        if report.is_empty():
            return None
        self.state.report = WorkerReport()
        return report

    def _digest(self, name: str) -> str:
        return name.removesuffix(self._suffix)

    def _probe_skipped_tiers(self) -> None:
        for tier in self.state.background:
            health = tier.health
            probe = getattr(tier.inner, "probe", None) or getattr(tier.inner, "ping", None)
            if probe is not None and health.probe_due():
                future = tier.run(probe)
                future.add_done_callback(
                    lambda f, h=health: h.probe_done(f.exception() is None, str(f.exception()))
                )

    def take_remote_calls(self) -> list[RemoteCall]:
        """Remote writes and deletes done since the last call (reads go with their loads)."""
        remote = self.state.tiers.get(REMOTE)
        if not isinstance(remote, BackgroundTier) or remote.calls is None:
            return []
        out = []
        while remote.calls:
            out.append(remote.calls.popleft())
        return out
