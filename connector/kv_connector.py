"""KVLensConnector: the class vLLM loads. It builds the scheduler or the worker half by role
and delegates each hook in a line or two."""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from telemetry import vllm_stats as telemetry
from telemetry.metrics import merge_payload
from telemetry.pd_recorder import pd_recorder

from .config.loading import ConfigError, load_config
from .config.pd import check_for_engine
from .engine.jobs import CPU, DISK, REMOTE, StepPlan
from .engine.outcomes import WorkerReport
from .engine.snapshots import KnownLabels
from .metadata import KVLensMetadata, KVLensWorkerMetadata
from .pd_roles import SchedulerPD, WorkerPD
from .scheduler.connector_scheduler import ConnectorScheduler
from .vllm_compat import (
    attention_in_full_graph,
    blend_separators,
    block_ids_of,
    engine_facts,
    kv_block_slots,
    kv_cache_events,
    model_identity,
    worker_rank,
)
from .vllm_plugin.model_hook import loaded_model
from .worker.blend.blend_worker import WorkerBlend
from .worker.connector_worker import ConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.kvlens")

# Connectors not shut down yet, shut down at interpreter exit. Weak: a registry that held them
# would keep an in-process engine's CPU tier alive after the engine is gone.
_OPEN: weakref.WeakSet[KVLensConnector] = weakref.WeakSet()


@atexit.register
def _shutdown_open_connectors() -> None:
    for connector in list(_OPEN):
        connector.shutdown()


_HIT_SOURCE = {
    CPU: CacheHitSource.HOST,
    DISK: CacheHitSource.DISK,
    REMOTE: CacheHitSource.EXTERNAL_UNSPECIFIED,
}  # vLLM files remote stores here; PD transfers are P2P


class KVLensConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        config = load_config(self._kv_transfer_config.kv_connector_extra_config or {})
        identity = None
        if role == KVConnectorRole.SCHEDULER:  # only the scheduler keys chunks
            identity = model_identity(vllm_config, config.extra_config.model_identity)
        facts = engine_facts(vllm_config, kv_cache_config, identity)
        problems = check_for_engine(
            config.pd,
            facts.kv_role,
            facts.world_size,
            config.chunk_size,
            facts.chunk_nbytes(config.chunk_size),
        )
        if config.enable_blending and config.pd.enabled:
            problems.append("enable_blending with PD roles: a blended prompt is not sent to a decoder yet")
        if problems:
            raise ConfigError("KVLens cannot start with this configuration: " + "; ".join(problems))
        self._num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else 0
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        self._scheduler_telemetry: Any = None
        self._worker_telemetry: Any = None
        self._pd_scheduler: SchedulerPD | None = None
        self._pd_worker: WorkerPD | None = None
        self._blend: WorkerBlend | None = None
        if role == KVConnectorRole.SCHEDULER:
            separators = (
                blend_separators(vllm_config, config.blend_special_str) if config.enable_blending else ()
            )
            self._scheduler = ConnectorScheduler(config, facts, blend_separators=separators)
            if config.pd.enabled:
                self._pd_scheduler = SchedulerPD(
                    config, facts, self._scheduler.state.hashers, pd_recorder(vllm_config)
                )
            self._scheduler_telemetry = telemetry.scheduler_recorder(
                vllm_config, facts.engine_id, facts.block_size, KnownLabels.for_tiers(config.tier_names())
            )
        elif role == KVConnectorRole.WORKER:
            self._worker = ConnectorWorker(config, facts, worker_rank())
            if config.enable_blending:
                self._blend = self._worker.blender(loaded_model)
            if config.pd.enabled:
                self._pd_worker = WorkerPD(config, facts, self._worker.rank)
            self._worker_telemetry = telemetry.worker_recorder(
                vllm_config,
                self._worker.rank,
                facts.block_bytes * facts.num_layers,
                self._worker.sizes,
                self._worker.take_remote_calls,
            )
        self._cache_hit_source = _HIT_SOURCE[(config.tier_names() or (CPU,))[0]]
        self._load_started = 0.0
        self._closed = False
        _OPEN.add(self)  # threads stop (bounded) at exit even if vLLM never calls shutdown
        logger.info("KVLens %s ready: %s", role.name.lower(), config.summary())

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped store is a future miss, never a lost result

    # ---- worker side --------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches, self._num_blocks, lambda kv: kv_block_slots(self._vllm_config, kv))
        if self._pd_worker is not None and self._pd_worker.sends is not None:
            self._pd_worker.sends.tails = self._worker.tail_slots

    def _meta(self) -> KVLensMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVLensMetadata)
        return meta

    def _plan(self) -> StepPlan:
        return self._meta().plan

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._load_started = self._worker_telemetry.now()
        layer_hooks = not attention_in_full_graph(forward_context)
        plan = self._plan()
        self._worker.start_load(plan, layer_hooks)  # reads done; copies run beside the forward
        if plan.blends and self._blend is not None:  # before the forward pass, which computes the last token
            started = self._worker_telemetry.now()
            outcomes = self._blend.run(plan.blends)
            self._worker.blended(outcomes, self._blend.take_store_failures())
            self._worker_telemetry.blended(plan.blends, outcomes, started)
        if self._pd_worker is not None:  # the decoder's records, from the receive buffer, now (async)
            self._pd_worker.load(self._meta().pd_loads, self._worker.copier, self._worker.failed_blocks)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        assert self._worker is not None
        self._worker.save_layer(self._plan(), layer_name)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        plan = self._plan()
        self._worker_telemetry.loaded(plan, self._worker.finish_load(), self._load_started)
        started = self._worker_telemetry.now()
        self._worker_telemetry.saved(plan, started, self._worker.save(plan))
        if self._pd_worker is not None:  # the prefiller's prompts, gathered now, sent on a thread
            failed = self._worker.failed_blocks | self._worker.step_failed
            self._pd_worker.send(self._meta().pd_sends, self._worker.copier, failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests vLLM finished (their store records close) and asynchronous loads that did
        (PD loads: every one in the step that made it, its failed blocks in the same output)."""
        assert self._worker is not None
        self._worker_telemetry.finished(finished_req_ids)
        meta = getattr(self, "_connector_metadata", None)  # bound until the step's end
        idle = isinstance(meta, KVLensMetadata) and meta.plan.idle
        received, done = self._worker.take_finished_loads(idle)
        if self._pd_worker is not None:
            received |= self._pd_worker.take_received()
        if done:
            now = self._worker_telemetry.now()
            spent = int(sum(outcome.seconds for _, outcome in done) * 1e9)
            self._worker_telemetry.loaded(
                StepPlan(loads=[job for job, _ in done]), [o for _, o in done], now - spent
            )
        return None, received or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_failed_blocks()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self._worker is not None
        report = self._worker.take_report()
        if self._pd_worker is not None:
            loads, sends = self._pd_worker.take()
            if loads or sends:
                return KVLensWorkerMetadata(report if report is not None else WorkerReport(), loads, sends)
        return KVLensWorkerMetadata(report) if report is not None else None

    # ---- scheduler side -----------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        rid = request.request_id
        with self._scheduler_telemetry.lookup(rid):
            need = self._scheduler.lookup(request, num_computed_tokens)
        if need is None:  # the remote tier's answer is on its way: vLLM asks again next step
            return None, False
        if self._pd_scheduler is not None:  # the PD receive buffer first (its load is asynchronous)
            pd = self._pd_scheduler.lookup(request, num_computed_tokens, need)
            if pd is not None:
                return pd
        return need, need > 0 and self._scheduler.loads_async(rid)

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        block_ids = block_ids_of(blocks) if num_external_tokens > 0 else None
        if self._pd_scheduler is not None:
            if self._pd_scheduler.readmitted(request.request_id):
                return  # scheduled after its PD load: its lookup was final at the claim
            if self._pd_scheduler.after_alloc(request, num_external_tokens, block_ids):
                num_external_tokens, block_ids = 0, None  # PD's tokens: the tiers' lookup loads none
        outcome = self._scheduler.after_alloc(request, num_external_tokens, block_ids)
        self._scheduler_telemetry.lookup_final(outcome)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        assert self._scheduler is not None
        if self._pd_scheduler is not None and self._pd_scheduler.hit_tokens(request.request_id):
            return {CacheHitSource.P2P: num_external_tokens}
        if self._scheduler.blends(request.request_id):  # computed by the blend from reused segments
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        by_tier = self._scheduler.external_tokens_by_tier(request.request_id, num_external_tokens)
        return {_HIT_SOURCE[tier]: n for tier, n in by_tier.items() if n}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        plan = self._scheduler.build_plan(scheduler_output)
        if self._pd_scheduler is None:
            return KVLensMetadata(plan)
        state = self._scheduler.state
        sends, loads = self._pd_scheduler.plan(scheduler_output, state.trackers, state.unfinished)
        return KVLensMetadata(plan, sends, loads)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.step_done()
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KVLensWorkerMetadata) and self._pd_scheduler is not None:
            self._pd_scheduler.on_worker_meta(meta.pd_loads, meta.pd_sends)
        if isinstance(meta, KVLensWorkerMetadata):
            report = meta.report
            recomputed = self._scheduler.on_worker_report(report)
            self._scheduler_telemetry.loads_reported(report.loads, recomputed, report.store_failures)
            self._scheduler_telemetry.blends_reported(report.blends)
            self._scheduler_telemetry.traffic_reported(report.traffic)
            self._scheduler_telemetry.requests_done(self._scheduler.take_done())
        stats = connector_output.kv_connector_stats
        self._scheduler_telemetry.on_worker_stats(stats.data if stats is not None else None)

    def take_events(self) -> list[Any]:
        """KVLens's stores and evictions as vLLM KV events (published with --kv-events-config)."""
        if self._scheduler is None or not self._scheduler.block_events.enabled:
            return []
        return kv_cache_events(self._scheduler.block_events.take())

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        result = self._scheduler.finish(request)
        self._scheduler_telemetry.finished(request.request_id, result.unscheduled_lookup)
        params, done = result.params, self._scheduler.take_done()
        if self._pd_scheduler is not None:  # tokens a prefiller sent count as KVLens's
            params, done = self._pd_scheduler.finish(request, params, done)
        self._scheduler_telemetry.requests_done(done)
        return False, params

    def has_pending_push_work(self) -> bool:
        """Background writes still landing, or what-if references to publish: keep stepping."""
        sched = self._scheduler
        if self._pd_scheduler is not None and self._pd_scheduler.pending():
            return True  # sends' ends (and the proxy's notices) and expiry happen in steps
        return sched is not None and (sched.has_pending_work() or sched.insight_behind())

    def reset_cache(self) -> bool | None:
        assert self._scheduler is not None
        self._scheduler.reset()
        return None

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._pd_scheduler is not None:
            self._pd_scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
        if self._pd_worker is not None:
            self._pd_worker.shutdown()
        for part in (self._scheduler_telemetry, self._worker_telemetry):
            if part is not None:
                part.shutdown()

    # ---- telemetry: vLLM's connector-stats path to /metrics ----------------------------
    def get_kv_connector_stats(self) -> telemetry.KVLensStats | None:
        if self._scheduler is not None:
            sched = self._scheduler
            data = self._scheduler_telemetry.stats(
                sched.sizes(),
                sched.insight_snapshot,
                not sched.unfinished,
                sched.take_evictions(),
                sched.take_saved_seconds(),
                sched.take_tenant_usage(),
            )
            if self._pd_scheduler is not None:
                pd = self._pd_scheduler.stats()
                if pd is not None:
                    data = merge_payload(data or {}, pd)
        else:
            data = self._worker_telemetry.stats()
        return telemetry.wrap(data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> telemetry.KVLensStats:
        return telemetry.KVLensStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> telemetry.KVLensPromMetrics:
        try:  # the series of the configured tiers exist (at zero) before any traffic
            tiers = load_config(vllm_config.kv_transfer_config.kv_connector_extra_config or {}).tier_names()
        except Exception as e:  # the engine reports configuration errors; metrics just start empty
            logger.debug("KVLens: no tiers for metrics: %s", e)
            tiers = ()
        return telemetry.KVLensPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues, KnownLabels.for_tiers(tiers)
        )
