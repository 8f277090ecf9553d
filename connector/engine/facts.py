"""What KVLens needs to know about the engine it runs in, gathered once from vLLM."""

from __future__ import annotations

from dataclasses import dataclass

from .keys import Namespace


@dataclass(frozen=True, slots=True)
class EngineFacts:
    model: str  # the served model (path or name) that produced the weights
    dtype: str  # KV cache dtype
    block_size: int  # tokens per vLLM block
    num_layers: int  # attention layers holding KV
    block_bytes: int  # bytes of one block of one layer on one rank
    kv_layout: str  # layout signature: shapes, physical order, attention kernel packing
    world_size: int  # tensor-parallel size (each rank stores its own share)
    kv_role: str  # kv_producer / kv_consumer / kv_both
    engine_id: str = "0"
    kv_events: bool = False  # vLLM publishes KV cache events (--kv-events-config)

    def namespace(self) -> Namespace:
        return Namespace(self.model, self.dtype, self.kv_layout, self.world_size)

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
