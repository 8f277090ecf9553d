"""What KVLens needs to know about the engine it runs in, gathered once from vLLM."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from .keys import Namespace


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """Everything about the model that changes the values of its KV (never where it lives)."""

    # "ckpt:<digest of every byte of the weights>", "named:<operator's name>", "dummy" (vLLM's
    # --load-format dummy) or, failing all, "path:<model>"
    weights: str
    # digest of the model's configuration as vLLM computes with it (overrides applied, paths
    # removed) and of the engine settings that change KV values (kv_settings: LongRoPE factors
    # chosen by max_model_len, attention options, ...)
    config: str
    dtype: str  # the dtype the model computes in
    quantization: str  # vLLM's quantization method, "none" without
    kv_cache_dtype: str  # vLLM's --kv-cache-dtype ("auto": the model's dtype)

    def key(self) -> str:
        return "|".join((self.weights, self.config, self.dtype, self.quantization, self.kv_cache_dtype))


RECORD_FORMAT = "kvlens-record-1"  # a rank's chunk bytes: [layers, blocks, block bytes] (the CPU tier's)


@dataclass(frozen=True, slots=True)
class EngineFacts:
    model: str  # the model's identity as it enters every key (ModelIdentity.key())
    dtype: str  # KV cache dtype
    block_size: int  # tokens per vLLM block
    num_layers: int  # attention layers holding KV
    block_bytes: int  # bytes of one block of one layer on one rank
    kv_layout: str  # layout signature: shapes, physical order, attention kernel packing
    world_size: int  # tensor-parallel size (each rank stores its own share)
    kv_role: str  # kv_producer / kv_consumer / kv_both
    engine_id: str = "0"
    kv_events: bool = False  # vLLM publishes KV cache events (--kv-events-config)
    identity: ModelIdentity | None = None  # the parts of ``model``, for the info gauge
    # vLLM's kv_load_failure_policy is "recompute": it keeps a failed load's blocks in its prefix
    # cache, where other requests hit them, until their owner has recomputed them
    failed_blocks_stay_cached: bool = False

    def namespace(self) -> Namespace:
        return Namespace(self.model, self.dtype, self.kv_layout, self.world_size)

    def record_layout(self) -> str:
        """What one rank's record bytes hold, short and equal for engines whose records are
        interchangeable (a PD prefiller and decoder must agree on it): the record format, KV
        dtype, layers, bytes per block and layer, a digest of the KV layout."""
        layout = hashlib.blake2b(self.kv_layout.encode(), digest_size=4).hexdigest()
        return f"{RECORD_FORMAT}/{self.dtype}/{self.num_layers}x{self.block_bytes}/{layout}"

    def chunk_nbytes(self, num_tokens: int) -> int:
        """Bytes one rank stores for a chunk of ``num_tokens`` tokens (whole blocks)."""
        blocks = -(-num_tokens // self.block_size)
        return blocks * self.block_bytes * self.num_layers

    @property
    def loads(self) -> bool:
        return self.kv_role != "kv_producer"

    @property
    def stores(self) -> bool:
        return self.kv_role != "kv_consumer"
