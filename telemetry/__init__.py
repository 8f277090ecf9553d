"""KVLens telemetry: OpenTelemetry spans, Prometheus metrics through vLLM's connector stats,
and the failed-load event log.

The connector's facade hands its typed outcomes to ``SchedulerRecorder`` (engine-core
process) and ``WorkerRecorder`` (worker processes); ``telemetry.vllm_stats`` holds the
vLLM-facing stats classes. Telemetry never imports the connector at run time and never
changes what it does. Settings are read once per process by ``TelemetrySettings.from_env``.
"""

from .metrics import METRICS, NAMES
from .scheduler_recorder import SchedulerRecorder
from .settings import TelemetrySettings
from .worker_recorder import WorkerRecorder

__all__ = ["METRICS", "NAMES", "SchedulerRecorder", "TelemetrySettings", "WorkerRecorder"]
