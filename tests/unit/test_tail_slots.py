"""Zeroing a chunk's slots past its tokens, without vLLM: a map of token slots is put into the
order payloads hold a block in, for every physical KV layout (GPU backends: a token is its index
in logical dim 2, whatever the strides), and applied to every layer of the chunk's last block."""

import numpy as np
import pytest
import torch

from connector.vllm_compat import kv_block_slots
from connector.worker.kv_blocks import BlockCopier
from connector.worker.tail_slots import MASKS_KEPT, TailSlots, map_problem, payload_order

from .test_kv_layouts import LAYOUTS

LAYERS, NUM_BLOCKS, HEADS, BS, HEAD = 3, 6, 2, 16, 4


def slot_coded(order: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Logical ``[B, H, N, 2*head]`` layers over one storage in ``order`` (a stride permutation of
    ``[L, B, H, N, C]``) whose every element is its token slot + 1."""
    logical = (LAYERS, NUM_BLOCKS, HEADS, BS, 2 * HEAD)
    physical = torch.empty(*(logical[d] for d in order), dtype=torch.float32)
    as_logical = physical.permute(*(order.index(d) for d in range(5)))
    as_logical.copy_((torch.arange(BS) + 1.0).view(1, 1, 1, BS, 1).expand(logical))
    return {f"model.layers.{i}.self_attn.attn": as_logical[i] for i in range(LAYERS)}


def slots_left(payload: torch.Tensor, position: int) -> np.ndarray:
    """The slot codes a payload block holds, per layer (0: zeroed)."""
    return payload[:, position].contiguous().view(torch.float32).numpy()


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("n", [1, 7, BS - 1])
def test_every_layout_keeps_the_chunks_slots_and_zeroes_the_rest(name, n):
    caches = slot_coded(LAYOUTS[name])
    copier = BlockCopier(caches, NUM_BLOCKS)
    first = next(iter(caches.values()))
    tails = TailSlots.of(copier, BS, kv_block_slots(None, first.to("meta")))  # a GPU's map
    payload = copier.gather([4, 1])
    assert tails.clear(payload, BS + n)
    assert np.array_equal(payload[:, 0], copier.gather([4])[:, 0])  # the full block is as it was
    left = slots_left(payload, 1)
    per_slot = HEADS * 2 * HEAD
    for layer in left:
        assert sorted(set(layer.tolist())) == [0.0, *range(1, n + 1)]
        assert (layer == 0).sum() == (BS - n) * per_slot


def test_kv_first_tensors_are_gathered_in_logical_order():
    """Older flash-attn ``[2, blocks, block_size, heads, head]``: a block's slots are its dim 1."""
    kv = (torch.arange(BS) + 1.0).view(1, 1, BS, 1, 1).expand(2, NUM_BLOCKS, BS, HEADS, HEAD).contiguous()
    copier = BlockCopier({"l0": kv, "l1": kv.clone()}, NUM_BLOCKS)
    assert not copier.rows
    block_slots = torch.arange(BS).view(1, BS, 1, 1).expand(2, BS, HEADS, HEAD)
    payload = copier.gather([3])
    assert TailSlots.of(copier, BS, block_slots).clear(payload, 5)
    left = slots_left(payload, 0)
    assert all(sorted(set(layer.tolist())) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] for layer in left)


def test_payload_order_is_memory_order_for_rows_and_logical_otherwise():
    caches = slot_coded(LAYOUTS["LBNHC"])  # rows, heads inside tokens
    order = payload_order(BlockCopier(caches, NUM_BLOCKS).layers[0])
    logical = np.arange(HEADS * BS * 2 * HEAD).reshape(HEADS, BS, 2 * HEAD)
    assert np.array_equal(order, logical.transpose(1, 0, 2).reshape(-1))
    caches = slot_coded(LAYOUTS["LHBNC"])  # not one run per block: gathered through an index
    assert np.array_equal(payload_order(BlockCopier(caches, NUM_BLOCKS).layers[0]), logical.reshape(-1))


def test_whole_blocks_past_the_tokens_are_zeroed_and_a_whole_chunk_is_left_alone():
    copier = BlockCopier(slot_coded(LAYOUTS["LBHNC"]), NUM_BLOCKS)
    tails = TailSlots.of(copier, BS, kv_block_slots(None, copier.layers[0].tensor.to("meta")))
    payload = copier.gather([1, 2, 3])
    assert tails.clear(payload, BS)
    assert bool((payload[:, 1:] == 0).all()) and np.array_equal(payload[:, 0], copier.gather([1])[:, 0])
    whole = copier.gather([1, 2])
    assert tails.clear(whole, 2 * BS) and torch.equal(whole, copier.gather([1, 2]))


def test_an_unknown_map_refuses_an_unfull_block_and_changes_nothing():
    copier = BlockCopier(slot_coded(LAYOUTS["LBHNC"]), NUM_BLOCKS)
    tails = TailSlots.of(copier, BS, None)
    payload = copier.gather([1, 2])
    assert not tails.known and not tails.clear(payload, BS + 3)
    assert torch.equal(payload, copier.gather([1, 2]))
    assert tails.clear(payload, 2 * BS)  # whole blocks need no map


@pytest.mark.parametrize(
    ("slots", "problem"),
    [
        (torch.zeros(HEADS, BS), "shape"),
        (torch.full((HEADS, BS, 2 * HEAD), BS), "outside"),
        (torch.arange(BS).view(1, BS, 1).expand(HEADS, BS, 2 * HEAD).clamp(max=BS - 2), "elements each"),
    ],
)
def test_a_map_that_is_not_one_slot_per_element_in_equal_shares_is_refused(slots, problem):
    copier = BlockCopier(slot_coded(LAYOUTS["LBHNC"]), NUM_BLOCKS)
    assert problem in map_problem(slots.long(), copier.block_shape, BS)
    assert not TailSlots.of(copier, BS, slots.long()).known


def test_masks_are_made_once_per_tail_length_and_bounded():
    block_size = 4 * MASKS_KEPT  # one 4-byte element per slot
    tails = TailSlots(block_size, np.arange(block_size, dtype=np.int32), 4)
    payload = torch.full((2, 1, 4 * block_size), 255, dtype=torch.uint8)
    assert tails.clear(payload, 3) and tails._keep_mask(3) is tails._keep_mask(3)
    assert bool((payload[:, 0, :12] == 255).all()) and bool((payload[:, 0, 12:] == 0).all())
    for tail in range(1, block_size):
        tails.clear(payload, tail)
    assert len(tails._keep) == MASKS_KEPT
