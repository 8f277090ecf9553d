"""Zeroes a chunk's token slots past its tokens before the chunk's bytes leave the worker.

vLLM hands a request blocks that other requests used, and KVLens copies whole blocks
(``kv_blocks``): a chunk that ends inside a block (a prompt's unfull last chunk) would carry, in
the slots past its tokens, the KV the block's previous occupant left there. Sent to a PD decoder
or stored in a shared tier, that is another request's data (layer-0 K/V give back its token
ids). So those slots are zeroed in every layer of what is sent or stored; the chunk's own slots
are left byte for byte as they are.

Which elements of a block hold which token slot depends on the attention kernel's packing
(REFERENCE.md 1.6: on CPU it differs by ISA). The map comes from ``vllm_compat.kv_block_slots``
in the logical order of one block; here it is put into the order a payload holds a block's bytes
in (``kv_blocks`` copies block-compact layouts in memory order) and applied as a bitwise AND with
a keep-mask per tail length, made the first time that length is seen. Where the map is unknown,
``clear`` says so and the caller does not let the chunk out.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch

from .kv_blocks import BlockCopier, LayerView

logger = logging.getLogger("vllm.kvlens")

MASKS_KEPT = 32  # keep-masks cached, one per tail length (each is one block's bytes)
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def payload_order(layer: LayerView) -> np.ndarray:
    """For each element of a block as a payload holds it, its index in the block's logical order
    (``kv[b]``, or ``kv[:, b]`` for K/V-first tensors). Blocks copied as rows are in memory order,
    the dimensions inside a block sorted by stride as ``kv_blocks`` sorts them; others are
    gathered through ``contiguous()``, in logical order."""
    block = layer.tensor.select(layer.block_dim, 0)
    index = torch.arange(block.numel()).view(block.shape)
    if layer.flat is not None:
        by_stride = sorted(range(block.dim()), key=lambda d: block.stride(d), reverse=True)
        index = index.permute(by_stride)
    return index.reshape(-1).numpy()


def map_problem(block_slots: torch.Tensor, block_shape: tuple[int, ...], block_size: int) -> str | None:
    """Why ``block_slots`` is not a map of every element of a block to one of its token slots,
    each slot holding an equal share; None if it is."""
    if tuple(block_slots.shape) != tuple(block_shape):
        return f"map of shape {tuple(block_slots.shape)} for blocks of shape {tuple(block_shape)}"
    slots = block_slots.reshape(-1).numpy()
    if slots.size == 0 or slots.min() < 0 or slots.max() >= block_size:
        return f"slots outside 0..{block_size - 1}"
    counts = np.bincount(slots, minlength=block_size)
    if counts.min() != counts.max():
        return f"token slots hold {counts.min()} to {counts.max()} elements each"
    return None


class TailSlots:
    """One rank's map of a payload block's elements to token slots, and the zeroing it allows."""

    def __init__(self, block_size: int, slots: np.ndarray | None = None, element_size: int = 1) -> None:
        self.block_size = block_size
        self.slots = slots  # token slot of each element of a payload block, in payload order
        self._unsigned = _UNSIGNED[element_size]
        self._keep: OrderedDict[int, np.ndarray] = OrderedDict()

    @classmethod
    def of(cls, copier: BlockCopier, block_size: int, block_slots: torch.Tensor | None) -> TailSlots:
        """The map for ``copier``'s payloads from ``block_slots`` (the token slot of each element of
        one block, in logical order; None: unknown). An unusable map is logged and left unknown."""
        problem = (
            "no map of token slots"
            if block_slots is None
            else map_problem(block_slots.cpu(), copier.block_shape, block_size)
        )
        if problem is not None:
            logger.warning(
                "KVLens: cannot tell which bytes of a KV block hold which token (%s): a prompt's "
                "unfull last chunk is neither sent to a PD decoder nor stored",
                problem,
            )
            return cls(block_size)
        assert block_slots is not None
        slots = block_slots.cpu().reshape(-1).numpy()[payload_order(copier.layers[0])]
        return cls(block_size, slots.astype(np.int32), copier.dtype.itemsize)

    @property
    def known(self) -> bool:
        return self.slots is not None

    def clear(self, payload: torch.Tensor, num_tokens: int) -> bool:
        """Zero, in every layer of ``payload`` (a chunk's blocks, ``[layers, blocks, block_bytes]``
        host bytes, the chunk starting at a block boundary), every token slot from ``num_tokens`` on.
        False, with nothing changed: the chunk ends inside a block and the map is unknown, so its
        bytes must not leave."""
        full, tail = divmod(num_tokens, self.block_size)
        if full >= payload.shape[1]:
            return True
        if tail:
            if self.slots is None:
                return False
            rows = payload[:, full].numpy().view(self._unsigned)  # [layers, elements]
            np.bitwise_and(rows, self._keep_mask(tail), out=rows)
            full += 1
        if full < payload.shape[1]:
            payload[:, full:].zero_()
        return True

    def _keep_mask(self, tail: int) -> np.ndarray:
        """All ones for the elements of slots below ``tail``, zero for the rest."""
        keep = self._keep.get(tail)
        if keep is None:
            assert self.slots is not None
            keep = np.where(self.slots < tail, np.iinfo(self._unsigned).max, 0).astype(self._unsigned)
            self._keep[tail] = keep
            if len(self._keep) > MASKS_KEPT:
                self._keep.popitem(last=False)
        else:
            self._keep.move_to_end(tail)
        return keep
