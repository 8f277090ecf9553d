"""KVLens telemetry: OpenTelemetry spans, Prometheus metrics through vLLM's connector stats,
per-response cache usage and the failed-load event log.

The connector uses ``SchedulerTelemetry`` (scheduler process) and ``WorkerTelemetry``
(worker processes); ``telemetry.vllm_stats`` holds the vLLM-facing stats classes. Settings
are read once per process by ``TelemetrySettings.from_env``.
"""

from .metrics import METRICS, NAMES
from .scheduler import SchedulerTelemetry
from .settings import TelemetrySettings
from .worker import WorkerTelemetry

__all__ = ["METRICS", "NAMES", "SchedulerTelemetry", "TelemetrySettings", "WorkerTelemetry"]
