"""Whole-block copies between vLLM's paged KV tensors and opaque chunk payloads.

A payload is ``[num_layers, num_blocks, block_bytes]`` bytes: for every layer, each block's
bytes in vLLM's own packing. Blocks are never sliced by token, because on CPU the attention
kernel packs K and V inside a block in an ISA-dependent way (REFERENCE.md 1.6); copying
whole blocks is correct for every packing and layout.

Layouts handled: block-first (``[num_blocks, ...]``: vLLM 0.32 on CPU and GPU) in any stride
permutation (``KVCacheLayout``), and K/V-first (``[2, num_blocks, ...]``: older flash-attn
style). Where each block is one run of bytes (every block-compact layout, GPU's default
``LBNHC`` included) blocks are copied as rows in memory order; elsewhere through an index.

On CUDA the payloads live in host memory, page-locked so that copies to and from the device
are asynchronous: they are queued on the caller's current stream (KVLens's copy stream,
``cuda_copies``) and complete later; the host reads a gathered payload only after the event
that follows its copies. Nothing here synchronises with the device except ``gather`` and
``scatter``, the whole-payload helpers that tests and benchmarks use.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger("vllm.kvlens")

CopyPairs = list[list[tuple[np.ndarray, np.ndarray]]]  # per layer: (destination, source) arrays

# On a device, blocks in up to this many runs of consecutive ids are copied one run at a time;
# more scattered ones are gathered on the device first (one copy and one index kernel per
# layer instead of a copy per run: a small copy costs more to queue than to run).
DIRECT_RUNS = 2
_INDEX_CACHE = 256  # device block-index tensors kept for reuse (per block-id tuple and stream)


@dataclass(frozen=True)
class LayerView:
    tensor: torch.Tensor
    block_dim: int  # 0 (block-first) or 1 (K/V-first)
    flat: torch.Tensor | None  # [num_blocks, row] view, one row per block, where blocks are runs


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


_ROW_TYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)  # widest first: faster copies


def _as_type(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The same bytes viewed as ``dtype`` (None: the row length or strides do not divide)."""
    try:
        return rows.view(dtype)
    except RuntimeError:
        return None


def _block_rows(kv: torch.Tensor) -> torch.Tensor | None:
    """``[num_blocks, block_bytes]`` uint8 rows over a block-first tensor whose every block is
    one run of bytes, in memory order (any stride permutation of the dimensions inside a
    block; blocks may be spaced apart, as when layers interleave); None where a block is not
    one run (heads or layers between a block's parts, ``LHBNC``)."""
    inner = kv[0]
    by_stride = sorted(range(inner.dim()), key=lambda d: inner.stride(d), reverse=True)
    if not inner.permute(by_stride).is_contiguous() or (kv.shape[0] > 1 and kv.stride(0) < inner.numel()):
        return None
    return _as_type(kv.as_strided((kv.shape[0], inner.numel()), (kv.stride(0), 1)), torch.uint8)


def _layer_views(kvs: list[torch.Tensor], num_blocks: int) -> list[LayerView]:
    """Every layer's view, its rows (if every layer has them) in the widest type all allow."""
    dims = [_block_dim(kv, num_blocks) for kv in kvs]
    rows = [_block_rows(kv) if dim == 0 else None for kv, dim in zip(kvs, dims, strict=True)]
    if any(r is None for r in rows):
        return [LayerView(kv, dim, None) for kv, dim in zip(kvs, dims, strict=True)]
    for dtype in _ROW_TYPES:
        typed = [_as_type(r, dtype) for r in rows]  # type: ignore[arg-type]
        if all(t is not None for t in typed):
            return [LayerView(kv, 0, t) for kv, t in zip(kvs, typed, strict=True)]
    raise AssertionError("uint8 rows always view as uint8")


def _block_dim(kv: torch.Tensor, num_blocks: int) -> int:
    if kv.shape[0] == num_blocks:
        return 0
    if kv.dim() > 1 and kv.shape[0] == 2 and kv.shape[1] == num_blocks:
        return 1
    raise ValueError(f"KV tensor of shape {tuple(kv.shape)} has no dimension of {num_blocks} blocks")


class BlockCopier:
    """Gathers and scatters whole blocks of every layer."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        if not kv_caches:
            raise ValueError("no KV cache tensors registered")
        names = list(kv_caches)
        self.layers = _layer_views([kv_caches[name] for name in names], num_blocks)
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
        self.rows = self.layers[0].flat is not None  # blocks are copied as rows (else by index)
        # copies to and from CUDA are queued (asynchronous) and go through page-locked memory
        self.asynchronous = self.device.type == "cuda"
        self._indexes: dict[tuple[object, ...], torch.Tensor] = {}
        # numpy views of CPU layers' rows, for copies a copy thread runs from prepared pairs
        # (None: some layer needs torch's indexed or device copies)
        cpu_rows = self.device.type == "cpu" and self.rows
        self._flat_np = [layer.flat.numpy() for layer in self.layers] if cpu_rows else None  # type: ignore[union-attr]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def payload_nbytes(self, num_blocks: int) -> int:
        return self.num_layers * num_blocks * self.block_bytes

    def layer_index(self, name: str) -> int | None:
        """Position of layer ``name`` in the registered KV tensors (None: not one of them)."""
        return self._index.get(name)

    def gather(self, block_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """A host uint8 tensor ``[layers, len(block_ids), block_bytes]``: ``out`` (a ``new_payload``
        buffer) filled, or a new one; complete when this returns."""
        if out is None:
            out = self.new_payload(len(block_ids))
        for i in range(self.num_layers):
            self.gather_layer(i, out, block_ids)
        self.synchronize()
        return out

    def new_payload(self, num_blocks: int) -> torch.Tensor:
        """An uninitialised ``[layers, num_blocks, block_bytes]`` uint8 host tensor (page-locked
        when the KV is on CUDA)."""
        return host_buffer((self.num_layers, num_blocks, self.block_bytes), self.asynchronous)

    def gather_layer(self, i: int, out: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Copy layer ``i``'s blocks ``block_ids`` into ``out[i]`` (queued, on CUDA)."""
        layer = self.layers[i]
        runs = _runs(block_ids)
        if layer.flat is not None and (not self.asynchronous or len(runs) <= DIRECT_RUNS):
            dst = out[i].view(layer.flat.dtype)
            for pos, first, n in runs:
                dst[pos : pos + n].copy_(layer.flat[first : first + n], non_blocking=self.asynchronous)
            return
        idx = self._device_index(block_ids)
        if layer.flat is not None:
            out[i].view(layer.flat.dtype).copy_(
                layer.flat.index_select(0, idx), non_blocking=self.asynchronous
            )
            return
        blocks = layer.tensor.index_select(layer.block_dim, idx)
        if layer.block_dim == 1:
            blocks = blocks.transpose(0, 1)
        rows = blocks.contiguous().view(torch.uint8).view(len(block_ids), -1)
        out[i].copy_(rows, non_blocking=self.asynchronous)

    def _device_index(self, block_ids: Sequence[int]) -> torch.Tensor:
        """``block_ids`` as an index tensor on the KV device. On CUDA it is copied in on the
        current stream and kept for that stream only (another stream could read it early)."""
        if not self.asynchronous:
            return torch.tensor(block_ids, dtype=torch.long, device=self.device)
        key = (tuple(block_ids), torch.cuda.current_stream(self.device).cuda_stream)
        idx = self._indexes.get(key)
        if idx is None:
            if len(self._indexes) >= _INDEX_CACHE:
                self._indexes.clear()
            host = torch.tensor(block_ids, dtype=torch.long).pin_memory()
            idx = self._indexes[key] = host.to(self.device, non_blocking=True)
        return idx

    def synchronize(self) -> None:
        """Return once every copy queued on the device is done (nothing to wait for on CPU)."""
        if self.asynchronous:
            torch.cuda.current_stream(self.device).synchronize()

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

    def load_targets(self, block_ids: Sequence[int]) -> list[list[tuple[int, memoryview]]] | None:
        """Per layer, (byte offset in a payload layer, writable bytes of the KV cache) for every
        run of ``block_ids`` (payload blocks 0..), in order: where a read may put a stored
        chunk's layers directly. None where the KV cache is not in host memory as rows."""
        if self._flat_np is None:
            return None
        out = []
        for rows in self._flat_np:
            runs = (
                _runs(block_ids) if rows.flags.c_contiguous else [(p, b, 1) for p, b in enumerate(block_ids)]
            )
            views = [(pos * self.block_bytes, memoryview(rows[b : b + n])) for pos, b, n in runs]
            if not all(view.contiguous for _, view in views):
                return None
            out.append([(start, view.cast("B")) for start, view in views])
        return out

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
        """Write payload blocks ``first_block ..`` into ``block_ids`` of every layer; done when
        this returns."""
        self.check_payload(payload, len(block_ids), first_block)
        for i in range(self.num_layers):
            self.scatter_layer(i, payload, block_ids, first_block)
        self.synchronize()

    def scatter_layer(
        self,
        i: int,
        payload: torch.Tensor,
        block_ids: Sequence[int],
        first_block: int,
    ) -> None:
        """Write layer ``i`` of payload blocks ``first_block ..`` into ``block_ids`` (a checked
        payload; queued, on CUDA: a payload not in page-locked memory is staged in some first)."""
        n = len(block_ids)
        src = payload[i, first_block : first_block + n]
        if self.asynchronous and not src.is_pinned():
            src = host_buffer(tuple(src.shape), True).copy_(src)
        layer = self.layers[i]
        runs = _runs(block_ids)
        if layer.flat is not None and (not self.asynchronous or len(runs) <= DIRECT_RUNS):
            rows = src.view(layer.flat.dtype)
            for pos, first, length in runs:
                layer.flat[first : first + length].copy_(
                    rows[pos : pos + length], non_blocking=self.asynchronous
                )
            return
        if self.device.type != "cpu":
            src = src.to(self.device, non_blocking=self.asynchronous)
        idx = self._device_index(block_ids)
        if layer.flat is not None:
            layer.flat.index_copy_(0, idx, src.view(layer.flat.dtype))
            return
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


_pinning_failed = False


def host_buffer(shape: tuple[int, ...], page_locked: bool) -> torch.Tensor:
    """An uninitialised uint8 host tensor; page-locked if asked and possible (a failed pinning
    is logged once and falls back to pageable memory: copies are then synchronous, not wrong)."""
    global _pinning_failed
    if page_locked and not _pinning_failed:
        try:
            return torch.empty(shape, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as e:
            _pinning_failed = True
            logger.warning("KVLens: cannot page-lock host buffers (%s); device copies will block", e)
    return torch.empty(shape, dtype=torch.uint8)
