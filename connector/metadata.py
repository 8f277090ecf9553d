"""The wire types vLLM carries between the scheduler and workers, wrapping KVLens's plans."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from .engine.jobs import StepPlan
from .engine.outcomes import WorkerReport


@dataclass
class KVLensMetadata(KVConnectorMetadata):
    """Scheduler to workers, once per step."""

    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class KVLensWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers to scheduler, once per step, merged across ranks."""

    report: WorkerReport = field(default_factory=WorkerReport)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVLensWorkerMetadata):
            self.report.merge(other.report)
        return self
