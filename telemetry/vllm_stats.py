"""vLLM's connector-stats types for KVLens: the payload object and its Prometheus side.

Only this telemetry module imports vLLM. ``KVLensStats`` crosses worker -> engine core ->
API server (pickled, then msgpack): its ``data`` is the plain payload of ``metrics.py``.
``KVLensPromMetrics`` is built once in the API server by ``build_prom_metrics``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from .metrics import PromRecorder, empty_payload, merge_payload, payload_is_empty, reduce_payload

logger = logging.getLogger("vllm.kvlens")


@dataclass
class KVLensStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = empty_payload()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other is not None and not other.is_empty():
            merge_payload(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return reduce_payload(self.data)

    def is_empty(self) -> bool:
        return payload_is_empty(self.data)


def wrap(data: dict[str, Any] | None) -> KVLensStats | None:
    return KVLensStats(data=data) if data else None


class KVLensPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._recorder = PromRecorder(metric_types, labelnames, per_engine_labelvalues, _tiers(vllm_config))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self._recorder.observe(transfer_stats_data, engine_idx)


def _tiers(vllm_config: Any) -> list[str]:
    """The configured tiers, so their series exist (at zero) before any traffic."""
    from connector.config import load_config

    try:
        config = load_config(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    except Exception as e:  # the engine reports configuration errors; metrics just start empty
        logger.debug("KVLens: no tiers for metrics: %s", e)
        return []
    return [name for name, on in (("cpu", config.local_cpu), ("disk", bool(config.local_disk))) if on]


def scheduler_telemetry(vllm_config: Any, scheduler: Any, facts: Any) -> Any:
    from .scheduler import SchedulerTelemetry
    from .settings import TelemetrySettings

    kv = vllm_config.kv_transfer_config
    return SchedulerTelemetry(
        scheduler,
        TelemetrySettings.from_env(vllm_config.observability_config.otlp_traces_endpoint),
        model_name=str(vllm_config.model_config.served_model_name),
        engine=str(facts.engine_id),
        block_size=facts.block_size,
        recompute_on_failure=getattr(kv, "kv_load_failure_policy", "fail") == "recompute",
    )


def worker_telemetry(vllm_config: Any, worker: Any, facts: Any) -> Any:
    from .settings import TelemetrySettings
    from .worker import WorkerTelemetry

    return WorkerTelemetry(
        TelemetrySettings.from_env(vllm_config.observability_config.otlp_traces_endpoint),
        rank=worker.rank,
        block_nbytes=facts.block_bytes * facts.num_layers,
        sizes=worker.sizes,
    )
