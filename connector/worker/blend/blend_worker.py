"""The worker's half of a blend: runs each ``BlendJob`` of the step before the forward pass.

Per job, on every rank in step (the model's row-parallel layers all-reduce): read the segment
chunks the scheduler found, agree across ranks on which were read (a chunk one rank could not
read is computed on every rank, or the ranks would compute different tokens), move and blend
(``assemble``, ``blender``), write tokens ``first``..``last - 1`` into the request's blocks
(``blend_output``), and store the chunks it computed (and promote those a slower tier supplied)
from its own output. A chunk that cannot be read is computed, never trusted; a blend that cannot
run at all (no model, a model the blender does not know) reports the request's blocks failed,
so vLLM computes them itself. Nothing here raises into vLLM.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...config.blend import BlendSettings
from ...engine.blend_jobs import BlendJob, SegmentChunkJob
from ...engine.jobs import REMOTE
from ...engine.keys import storage_name
from ...engine.outcomes import BlendOutcome, ChunkProblem, FailureReason, StoreFailure
from ...engine.segment_keys import SegmentChunk
from ...engine.segment_records import SegmentRecordInvalid
from ...tiers.background import QueueFull
from ...tiers.base import ChunkCorrupt, ChunkMissing, classify
from .assemble import LoadedChunk, blend_input
from .blend_output import chunk_payloads, write_blocks
from .blender import BlendInput, BlendResult, blend
from .paged_write import attention_modules
from .rope_shift import RopeNotShiftable, vllm_rope_shift
from .segment_kv import from_payload, shape_of
from .selection import CheckLayer
from .vllm_llama import NotBlendable, VllmLlama

logger = logging.getLogger("vllm.kvlens")


class BlendBacking:
    """The loaded model behind the blender, found once (``model_hook``), with what it needs."""

    def __init__(self, model: Any, settings: BlendSettings) -> None:
        self.model = VllmLlama(model)
        problem = settings.layers_problem(len(self.model.layers))
        if problem is not None:
            raise NotBlendable(problem)
        self.attention = attention_modules(model)
        first = model.model.layers[0].self_attn
        self.shift = vllm_rope_shift(first.rotary_emb)
        self.kv_heads = int(first.num_kv_heads)
        self.head_size = int(first.head_dim)
        self.max_positions = int(first.rotary_emb.max_position_embeddings)
        self.dtype = next(model.parameters()).dtype
        self.checks = [
            CheckLayer(layer, ratio, None if settings.thresholds is None else settings.thresholds[i])
            for i, (layer, ratio) in enumerate(
                zip(settings.check_layers, settings.recompute_ratios, strict=True)
            )
        ]

    def empty_kv(self, count: int) -> list[torch.Tensor]:
        return [
            torch.zeros(count, self.kv_heads, self.head_size, dtype=self.dtype) for _ in self.model.layers
        ]


Put = Callable[[str, str, memoryview, str, int], None]  # tier, name, payload, namespace, tokens


def vllm_backing(find_model: Callable[[], Any], settings: BlendSettings) -> Callable[[], BlendBacking]:
    """Makes the backing from the model KVLens's plugin remembered (``model_hook``)."""

    def make() -> BlendBacking:
        model = find_model()
        if model is None:
            raise NotBlendable("no model was remembered for this engine (the KVLens plugin did not run)")
        return BlendBacking(model, settings)

    return make


class WorkerBlend:
    def __init__(
        self,
        rank: int,
        block_size: int,
        tiers: dict[str, Any],
        usable: Callable[[str], bool],
        put: Put,
        make_backing: Callable[[], Any],
    ) -> None:
        self.rank = rank
        self.block_size = block_size
        self.tiers = tiers
        self.usable = usable
        self.put = put
        self._make_backing = make_backing
        self._backing: Any = None
        self._unusable: str | None = None
        self.store_failures: list[StoreFailure] = []

    def backing(self) -> BlendBacking:
        """The model behind the blender, made at the first blend (vLLM loads the model after
        the connector starts); a model it cannot blend is said once and every blend fails."""
        if self._backing is None and self._unusable is None:
            try:
                self._backing = self._make_backing()
            except (NotBlendable, RopeNotShiftable, AttributeError) as e:
                self._unusable = str(e)
                logger.error("KVLens: blending is off for this engine: %s; blended requests are computed", e)
        if self._backing is None:
            raise NotBlendable(self._unusable or "no model")
        return self._backing

    def run(self, jobs: Sequence[BlendJob]) -> list[BlendOutcome]:
        return [self._run(job) for job in jobs]

    def _run(self, job: BlendJob) -> BlendOutcome:
        started = time.perf_counter()
        outcome = BlendOutcome(job.request_id, tokens=len(job.token_ids))
        try:
            backing = self.backing()
            with torch.inference_mode():
                loaded, payloads = self._read(job, backing, outcome)
                result = blend(backing.model, self._input(job, backing, loaded), backing.checks)
                outcome.written_tokens = write_blocks(
                    backing.attention, result, job.block_ids, self.block_size, job.first, job.last
                )
            _note(outcome, result)
            self._store(job, result, loaded, payloads, outcome)
        except Exception as e:  # noqa: BLE001 - vLLM computes what the blend could not write
            reason = f"{type(e).__name__}: {e}"
            if not isinstance(e, NotBlendable):
                logger.exception(
                    "KVLens: request %s: the blend failed; vLLM computes its prompt", job.request_id
                )
            outcome.failed = reason
            first_block, end_block = job.first // self.block_size, -(-job.last // self.block_size)
            outcome.failed_block_ids = list(job.block_ids[first_block:end_block])
            outcome.reused_by_tier = {}
            for chunk in job.chunks:  # admitted by the scheduler for a write that never came
                for tier in chunk.store_to:
                    self._failed(job, chunk, tier, FailureReason.DEPENDENCY_FAILED, "the blend failed")
        outcome.seconds = time.perf_counter() - started
        return outcome

    # ---- reading -------------------------------------------------------------------------
    def _read(
        self, job: BlendJob, backing: BlendBacking, outcome: BlendOutcome
    ) -> tuple[list[tuple[SegmentChunkJob, LoadedChunk]], dict[str, memoryview]]:
        """The chunks every rank read; their payloads as read (for promotion)."""
        shape = shape_of(backing.empty_kv(1))
        wanted = [c for c in job.chunks if c.tier is not None]
        got: list[tuple[SegmentChunkJob, LoadedChunk] | None] = []
        payloads: dict[str, memoryview] = {}
        for chunk, read in zip(wanted, self._fetch(wanted), strict=True):
            assert chunk.tier is not None
            try:
                if isinstance(read, BaseException):
                    raise read
                position, keys, values = from_payload(
                    read, shape, backing.dtype, chunk.num_tokens, backing.max_positions
                )
                got.append((chunk, LoadedChunk(chunk.start, position, keys, values)))
                payloads[chunk.name] = read
            except _Skipped:
                got.append(None)
                outcome.problems.append(ChunkProblem(chunk.tier, chunk.name, FailureReason.TIER_UNHEALTHY))
            except ChunkMissing as e:
                got.append(None)
                if chunk.tier != REMOTE:  # the remote was only tried: a miss there is no problem
                    outcome.problems.append(
                        ChunkProblem(chunk.tier, chunk.name, FailureReason.MISSING, str(e))
                    )
            except (ChunkCorrupt, SegmentRecordInvalid) as e:
                got.append(None)
                outcome.problems.append(ChunkProblem(chunk.tier, chunk.name, FailureReason.CORRUPT, str(e)))
            except (OSError, TimeoutError, ValueError) as e:
                got.append(None)
                reason, detail = classify(e)
                outcome.problems.append(ChunkProblem(chunk.tier, chunk.name, reason, detail))
        # Every rank must blend the same tokens: a chunk any rank lacks is computed on all.
        missing = torch.tensor([0.0 if g is not None else 1.0 for g in got] or [0.0])
        missing = backing.model.sum_across_ranks(missing)
        loaded = [g for g, m in zip(got, missing.tolist(), strict=False) if g is not None and m == 0]
        for chunk, _ in loaded:
            outcome.reused_by_tier[chunk.tier or ""] = (
                outcome.reused_by_tier.get(chunk.tier or "", 0) + chunk.num_tokens
            )
        return loaded, payloads

    def _fetch(self, chunks: list[SegmentChunkJob]) -> list[memoryview | BaseException]:
        """Each chunk's payload or the error reading it, in order; a tier that reads many at once
        (the slow ones, with one deadline) is asked once."""
        by_tier: dict[str, list[int]] = {}
        for i, chunk in enumerate(chunks):
            by_tier.setdefault(chunk.tier or "", []).append(i)
        out: list[memoryview | BaseException] = [_Skipped()] * len(chunks)
        for tier_name, indices in by_tier.items():
            tier = self.tiers.get(tier_name)
            if tier is None or not self.usable(tier_name):
                continue
            names = [storage_name(chunks[i].name, self.rank) for i in indices]
            if hasattr(tier, "get_many"):
                results = list(tier.get_many(names))
            else:
                results = []
                for name in names:
                    try:
                        results.append(tier.get(name))
                    except Exception as e:  # noqa: BLE001 - handed on as a value
                        results.append(e)
            for i, result in zip(indices, results, strict=True):
                out[i] = result if isinstance(result, BaseException) else memoryview(result)
        return out

    def _input(
        self, job: BlendJob, backing: BlendBacking, loaded: list[tuple[SegmentChunkJob, LoadedChunk]]
    ) -> BlendInput:
        ids = torch.tensor(job.token_ids, dtype=torch.long)
        if loaded:
            return blend_input(ids, [chunk for _, chunk in loaded], backing.shift, backing.dtype)
        count = ids.shape[0]
        empty = backing.empty_kv(count)
        return BlendInput(ids, torch.arange(count), torch.zeros(count, dtype=torch.bool), empty, empty)

    # ---- storing -------------------------------------------------------------------------
    def _store(
        self,
        job: BlendJob,
        result: BlendResult,
        loaded: list[tuple[SegmentChunkJob, LoadedChunk]],
        payloads: dict[str, memoryview],
        outcome: BlendOutcome,
    ) -> None:
        read = {chunk.name: chunk.tier for chunk, _ in loaded}
        computed = [c for c in job.chunks if c.name not in read and c.store_to]
        made = {
            seg.digest.hex(): payload
            for seg, payload in chunk_payloads(result, [_segment_chunk(c) for c in computed])
        }
        for chunk in job.chunks:
            if chunk.name in read:
                tiers = [t for t in chunk.store_to if t != read[chunk.name]]
                payload = payloads.get(chunk.name)
            else:
                tiers, payload = list(chunk.store_to), made.get(chunk.name)
            if not tiers or payload is None:
                continue
            view = memoryview(bytearray(payload))  # its own memory: the CPU tier keeps this object
            wrote = False
            for tier in tiers:
                if tier not in self.tiers or not self.usable(tier):
                    self._failed(job, chunk, tier, FailureReason.TIER_UNHEALTHY, "")
                    continue
                try:
                    self.put(tier, storage_name(chunk.name, self.rank), view, job.namespace, chunk.num_tokens)
                    wrote = True
                except QueueFull as e:
                    self._failed(job, chunk, tier, FailureReason.QUEUE_FULL, str(e))
                except OSError as e:
                    self._failed(job, chunk, tier, *classify(e))
            outcome.stored += int(wrote)

    def _failed(
        self, job: BlendJob, chunk: SegmentChunkJob, tier: str, reason: FailureReason, detail: str
    ) -> None:
        self.store_failures.append(StoreFailure(job.request_id, chunk.name, tier, reason, detail))

    def take_store_failures(self) -> list[StoreFailure]:
        out, self.store_failures = self.store_failures, []
        return out


def _note(outcome: BlendOutcome, result: BlendResult) -> None:
    report = result.report
    outcome.recomputed = report.recomputed
    outcome.by_deviation = report.by_deviation
    outcome.not_reused = report.not_reused
    if report.checks:
        outcome.deviation_mean = report.checks[0].deviation_mean
        outcome.deviation_max = report.checks[0].deviation_max


class _Skipped(Exception):
    pass


def _segment_chunk(chunk: SegmentChunkJob) -> SegmentChunk:
    return SegmentChunk(bytes.fromhex(chunk.name), chunk.start, chunk.num_tokens, 0, 0)
