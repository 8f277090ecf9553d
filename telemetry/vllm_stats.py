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
        known: Any = None,
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._recorder = PromRecorder(metric_types, labelnames, per_engine_labelvalues, known)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self._recorder.observe(transfer_stats_data, engine_idx)


def scheduler_recorder(vllm_config: Any, engine: str, block_size: int, known: Any) -> Any:
    from .scheduler_recorder import SchedulerRecorder
    from .settings import TelemetrySettings

    kv = vllm_config.kv_transfer_config
    return SchedulerRecorder(
        TelemetrySettings.from_env(vllm_config.observability_config.otlp_traces_endpoint),
        model_name=str(vllm_config.model_config.served_model_name),
        engine=engine,
        block_size=block_size,
        recompute_on_failure=getattr(kv, "kv_load_failure_policy", "fail") == "recompute",
        known=known,
    )


def worker_recorder(
    vllm_config: Any, rank: int, block_nbytes: int, sizes: Any, background_calls: Any = None
) -> Any:
    from .settings import TelemetrySettings
    from .worker_recorder import WorkerRecorder

    return WorkerRecorder(
        TelemetrySettings.from_env(vllm_config.observability_config.otlp_traces_endpoint),
        rank=rank,
        block_nbytes=block_nbytes,
        sizes=sizes,
        background_calls=background_calls,
    )
