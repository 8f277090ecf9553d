"""Every physical KV layout vLLM 0.32 declares (``KVCacheLayout``: a stride permutation of
logical ``[L, B, H, N, C]``): whole blocks round-trip exactly, and where a block is one run of
bytes (block-compact layouts, GPU's default ``LBNHC`` among them) it is copied as a row, in
memory order, by the same prepared copies as the contiguous CPU layout."""

import pytest
import torch

from connector.engine.jobs import CPU, ChunkLoad, LoadJob, StepPlan, StoreJob
from connector.worker.kv_blocks import BlockCopier

from .test_worker import BS, HEAD, HEADS, LAYERS, NAME, NUM_BLOCKS, worker

# name -> stride order of logical [L, B, H, N, C] (vllm/v1/kv_cache_layout.py)
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
BLOCK_COMPACT = {"LBHNC", "LBNHC", "BLHNC", "BLNHC"}  # L and B outermost: a block is one run


def layout(name: str, seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per-layer logical ``[B, H, N, 2*head]`` views of one storage in ``name``'s physical order."""
    order = LAYOUTS[name]
    logical = (LAYERS, NUM_BLOCKS, HEADS, BS, 2 * HEAD)
    gen = torch.Generator().manual_seed(seed)
    physical = torch.randn(*(logical[d] for d in order), generator=gen).to(torch.bfloat16)
    as_logical = physical.permute(*(order.index(d) for d in range(5)))
    return {f"model.layers.{i}.self_attn.attn": as_logical[i] for i in range(LAYERS)}, physical


@pytest.mark.parametrize("name", LAYOUTS)
def test_whole_blocks_round_trip_exactly_in_every_layout(name):
    (src, _), (dst, _) = layout(name, 0), layout(name, 1)
    cs, cd = BlockCopier(src, NUM_BLOCKS), BlockCopier(dst, NUM_BLOCKS)
    untouched = {n: t.clone() for n, t in dst.items()}
    cd.scatter(cs.gather([3, 7, 9, 10]), [12, 1, 2], first_block=1)
    for n in src:
        assert torch.equal(dst[n][[12, 1, 2]], src[n][[7, 9, 10]])
        others = [b for b in range(NUM_BLOCKS) if b not in (12, 1, 2)]
        assert torch.equal(dst[n][others], untouched[n][others])


@pytest.mark.parametrize("name", LAYOUTS)
def test_blocks_are_rows_in_memory_order_where_each_is_one_run_of_bytes(name):
    caches, physical = layout(name)
    copier = BlockCopier(caches, NUM_BLOCKS)
    assert copier.rows == (name in BLOCK_COMPACT)
    assert (copier.load_pairs(copier.gather([4]), [5], 0) is not None) == (name in BLOCK_COMPACT)
    if name in BLOCK_COMPACT:
        payload = copier.gather([4, 11])
        for i in range(LAYERS):
            for pos, b in enumerate((4, 11)):
                run = physical[i, b] if name.startswith("LB") else physical[b, i]  # vLLM's own bytes
                assert torch.equal(payload[i, pos], run.contiguous().view(torch.uint8).flatten())


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("layerwise", [True, False])
def test_the_worker_stores_and_loads_every_layout(name, layerwise):
    caches, _ = layout(name)
    w = worker(caches, use_layerwise=layerwise)
    w.save(StepPlan(writes=[StoreJob("a", NAME, (2, 5), (CPU,), 32)]))
    plan = StepPlan(loads=[LoadJob("b", (ChunkLoad(NAME, CPU, (9, 8), 0, 32),))])
    w.start_load(plan)
    for n in caches:
        w.wait_layer(n)
    (outcome,) = w.finish_load()
    w.save(plan)
    assert not outcome.failed
    for t in caches.values():
        assert torch.equal(t[[9, 8]], t[[2, 5]])


@pytest.mark.parametrize("name", [*LAYOUTS, "KV-first"])
def test_the_device_copy_branches_move_the_same_bytes_as_the_host_ones(name, monkeypatch):
    """On CUDA, fragmented blocks go through an index and payloads through staging buffers;
    forced on here (CPU tensors, no page-locked memory), they must move what the host path does."""
    import connector.worker.kv_blocks as kv_blocks

    monkeypatch.setattr(kv_blocks, "_pinning_failed", False)  # this build cannot pin: it falls back
    if name == "KV-first":
        src = {f"l{i}": torch.randn(2, NUM_BLOCKS, BS, HEADS, HEAD) for i in range(LAYERS)}
        dst = {n: torch.randn_like(t) for n, t in src.items()}
    else:
        (src, _), (dst, _) = layout(name, 0), layout(name, 1)
    host = BlockCopier(src, NUM_BLOCKS)
    cs, cd = BlockCopier(src, NUM_BLOCKS), BlockCopier(dst, NUM_BLOCKS)
    for copier in (cs, cd):
        copier.asynchronous = True
        monkeypatch.setattr(copier, "_device_index", lambda ids: torch.tensor(ids, dtype=torch.long))
        monkeypatch.setattr(copier, "synchronize", lambda: None)  # nothing queued on a CPU
    for ids, into in (([3, 4, 5], [10, 11, 12]), ([9, 1, 14, 6], [2, 13, 7, 0])):  # one run; four
        payload = cs.gather(ids)
        assert torch.equal(payload, host.gather(ids))
        cd.scatter(payload, into, first_block=0)
        axis = 1 if name == "KV-first" else 0
        for n in src:
            assert torch.equal(
                dst[n].index_select(axis, torch.tensor(into)), src[n].index_select(axis, torch.tensor(ids))
            )
