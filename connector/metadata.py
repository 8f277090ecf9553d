"""The wire types vLLM carries between the scheduler and workers, wrapping KVLens's plans."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from .engine.jobs import StepPlan
from .engine.outcomes import WorkerReport
from .engine.pd_jobs import PDLoadJob, PDLoadResult, PDSendJob, PDSendReport


@dataclass
class KVLensMetadata(KVConnectorMetadata):
    """Scheduler to workers, once per step."""

    plan: StepPlan = field(default_factory=StepPlan)
    pd_sends: list[PDSendJob] = field(default_factory=list)  # prefiller: gather after the forward
    pd_loads: list[PDLoadJob] = field(default_factory=list)  # decoder: load in this step (async)


@dataclass
class KVLensWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers to scheduler, once per step, merged across ranks."""

    report: WorkerReport = field(default_factory=WorkerReport)
    pd_loads: dict[str, PDLoadResult] = field(default_factory=dict)  # decoder: by request, every rank
    pd_sends: list[PDSendReport] = field(default_factory=list)  # prefiller: transfers that ended

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVLensWorkerMetadata):
            self.report.merge(other.report)
            for rid, result in other.pd_loads.items():
                mine = self.pd_loads.get(rid)
                if mine is None:
                    self.pd_loads[rid] = result
                else:
                    mine.merge(result)
            self.pd_sends += other.pd_sends
        return self
