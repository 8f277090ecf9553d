"""Whole-block copies between vLLM's paged KV tensors and opaque chunk payloads.

A payload is ``[num_layers, num_blocks, block_bytes]`` bytes: for every layer, each block's
bytes in vLLM's own packing. Blocks are never sliced by token, because on CPU the attention
kernel packs K and V inside a block in an ISA-dependent way (REFERENCE.md 1.6); copying
whole blocks is correct for every packing and layout.

Layouts handled: block-first (``[num_blocks, ...]``: vLLM 0.32 on CPU and GPU) and
K/V-first (``[2, num_blocks, ...]``: older flash-attn style).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

CopyPairs = list[list[tuple[np.ndarray, np.ndarray]]]  # per layer: (destination, source) arrays


@dataclass(frozen=True)
class LayerView:
    tensor: torch.Tensor
    block_dim: int  # 0 (block-first) or 1 (K/V-first)
    flat: torch.Tensor | None  # [num_blocks, block_bytes] uint8 view when blocks are contiguous


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(position in block_ids, first block id, length) for each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for pos, b in enumerate(block_ids):
        if runs and runs[-1][1] + runs[-1][2] == b:
            start, first, n = runs[-1]
            runs[-1] = (start, first, n + 1)
        else:
            runs.append((pos, b, 1))
    return runs


def _layer_number(name: str) -> int:
    numbers = re.findall(r"\.(\d+)(?:\.|$)", name)
    return int(numbers[0]) if numbers else -1


def _widest_view(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as the widest integer type that divides a row: copies run far faster."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if t.shape[-1] % size == 0:
            return t.view(dtype)
    return t


def _layer_view(kv: torch.Tensor, num_blocks: int) -> LayerView:
    if kv.shape[0] == num_blocks:
        block_dim = 0
    elif kv.dim() > 1 and kv.shape[0] == 2 and kv.shape[1] == num_blocks:
        block_dim = 1
    else:
        raise ValueError(f"KV tensor of shape {tuple(kv.shape)} has no dimension of {num_blocks} blocks")
    flat = None
    if block_dim == 0 and kv.is_contiguous():
        flat = _widest_view(kv.view(torch.uint8).view(num_blocks, -1))
    return LayerView(kv, block_dim, flat)


class BlockCopier:
    """Gathers and scatters whole blocks of every layer."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        if not kv_caches:
            raise ValueError("no KV cache tensors registered")
        names = list(kv_caches)
        self.layers = [_layer_view(kv_caches[name], num_blocks) for name in names]
        self._index = {name: i for i, name in enumerate(names)}
        # The order the forward pass reaches the layers in (the number in the layer's name),
        # so that copies run ahead of it; registration order where names carry no number.
        self.order = sorted(range(len(names)), key=lambda i: (_layer_number(names[i]), i))
        first = self.layers[0].tensor
        self.device = first.device
        self.dtype = first.dtype
        per_block = list(first.shape)
        del per_block[self.layers[0].block_dim]
        self.block_shape = tuple(per_block)
        self.block_bytes = first.element_size() * int(torch.Size(per_block).numel())
        for layer in self.layers:
            if layer.tensor.dtype != self.dtype or layer.tensor.shape != first.shape:
                raise ValueError("KVLens needs every layer's KV tensor to have one shape and dtype")
        # numpy views of contiguous CPU layers, for copies a copy thread runs from prepared
        # pairs (None: some layer needs torch's strided or device copies)
        cpu_flat = self.device.type == "cpu" and all(layer.flat is not None for layer in self.layers)
        self._flat_np = [layer.flat.numpy() for layer in self.layers] if cpu_flat else None  # type: ignore[union-attr]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def payload_nbytes(self, num_blocks: int) -> int:
        return self.num_layers * num_blocks * self.block_bytes

    def layer_index(self, name: str) -> int | None:
        """Position of layer ``name`` in the registered KV tensors (None: not one of them)."""
        return self._index.get(name)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """A CPU uint8 tensor ``[layers, len(block_ids), block_bytes]``: ``out`` (a ``new_payload``
        buffer) filled, or a new one."""
        if out is None:
            out = self.new_payload(len(block_ids))
        for i in range(self.num_layers):
            self.gather_layer(i, out, block_ids)
        return out if self.device.type == "cpu" else out.cpu()

    def new_payload(self, num_blocks: int) -> torch.Tensor:
        """An uninitialised ``[layers, num_blocks, block_bytes]`` uint8 tensor on the KV device."""
        return torch.empty(
            (self.num_layers, num_blocks, self.block_bytes), dtype=torch.uint8, device=self.device
        )

    def gather_layer(self, i: int, out: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Copy layer ``i``'s blocks ``block_ids`` into ``out[i]``."""
        layer = self.layers[i]
        if layer.flat is not None:
            dst = _widest_view(out[i])
            for pos, first, n in _runs(block_ids):
                dst[pos : pos + n].copy_(layer.flat[first : first + n])
            return
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        blocks = layer.tensor.index_select(layer.block_dim, idx)
        if layer.block_dim == 1:
            blocks = blocks.transpose(0, 1)
        out[i].copy_(blocks.contiguous().view(torch.uint8).view(len(block_ids), -1))

    def load_pairs(
        self, payload: torch.Tensor, block_ids: Sequence[int], first_block: int
    ) -> CopyPairs | None:
        """Per layer, the (destination, source) arrays that write payload blocks ``first_block ..``
        into ``block_ids`` (a checked payload): views made here, so that the thread that copies
        runs only ``np.copyto``, holding the GIL for as little as possible beside the forward
        pass. None where the layout needs torch's copies."""
        if self._flat_np is None:
            return None
        src = payload[:, first_block : first_block + len(block_ids)].numpy().view(self._flat_np[0].dtype)
        runs = _runs(block_ids)
        return [
            [(dst[b : b + n], src[i, pos : pos + n]) for pos, b, n in runs]
            for i, dst in enumerate(self._flat_np)
        ]

    def gather_pairs(self, out: torch.Tensor, block_ids: Sequence[int]) -> CopyPairs | None:
        """Per layer, the (destination, source) arrays that copy blocks ``block_ids`` into ``out``."""
        if self._flat_np is None:
            return None
        dst = out.numpy().view(self._flat_np[0].dtype)
        runs = _runs(block_ids)
        return [
            [(dst[i, pos : pos + n], src[b : b + n]) for pos, b, n in runs]
            for i, src in enumerate(self._flat_np)
        ]

    def check_payload(self, payload: torch.Tensor, num_blocks: int, first_block: int) -> None:
        """Raises ValueError unless ``payload`` holds blocks ``first_block ..`` + ``num_blocks``."""
        stored_blocks = payload.shape[1]
        if payload.shape[0] != self.num_layers or first_block + num_blocks > stored_blocks:
            raise ValueError(
                f"payload holds {payload.shape[0]} layers x {stored_blocks} blocks; "
                f"need {self.num_layers} layers x blocks {first_block}..{first_block + num_blocks - 1}"
            )

    def scatter(self, payload: torch.Tensor, block_ids: Sequence[int], first_block: int) -> None:
        """Write payload blocks ``first_block ..`` into ``block_ids`` of every layer."""
        self.check_payload(payload, len(block_ids), first_block)
        for i in range(self.num_layers):
            self.scatter_layer(i, payload, block_ids, first_block)

    def scatter_layer(
        self,
        i: int,
        payload: torch.Tensor,
        block_ids: Sequence[int],
        first_block: int,
    ) -> None:
        """Write layer ``i`` of payload blocks ``first_block ..`` into ``block_ids`` (a checked payload)."""
        n = len(block_ids)
        src = payload[i, first_block : first_block + n]
        if self.device.type != "cpu":
            src = src.to(self.device, non_blocking=True)
        layer = self.layers[i]
        if layer.flat is not None:
            rows = src if layer.flat.dtype == torch.uint8 else src.contiguous().view(layer.flat.dtype)
            for pos, first, length in _runs(block_ids):
                layer.flat[first : first + length].copy_(rows[pos : pos + length])
            return
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        typed = src.contiguous().view(self.dtype).view(n, *self.block_shape)
        if layer.block_dim == 1:
            typed = typed.transpose(0, 1)
        layer.tensor.index_copy_(layer.block_dim, idx, typed)

    def payload_view(self, buffer: memoryview) -> torch.Tensor:
        """Interpret stored bytes as a payload tensor (no copy)."""
        total = buffer.nbytes
        per_block_all_layers = self.num_layers * self.block_bytes
        if total == 0 or total % per_block_all_layers:
            raise ValueError(f"payload of {total} bytes is not whole blocks of this KV layout")
        if buffer.readonly:
            with warnings.catch_warnings():  # a read-only buffer (a remote read) is fine: only read
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                flat = torch.frombuffer(buffer, dtype=torch.uint8)
        else:
            flat = torch.frombuffer(buffer, dtype=torch.uint8)
        return flat.view(self.num_layers, total // per_block_all_layers, self.block_bytes)
