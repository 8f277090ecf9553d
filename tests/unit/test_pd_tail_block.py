"""A prompt's unfull last block leaves the worker without the KV its previous occupant left.

vLLM's own CPU kernel writes the KV (``cpu_attn_reshape_and_cache``, with the ISA its backend
picks): first another prompt fills a block, then a request writes only its first ``n`` slots of
it. What the PD sender is handed, and what the tiers store of an exact unfull chunk, must hold
zeros in every element of slots ``n ..`` of that block, in every layer, and the request's own
bytes unchanged. Which elements are a slot's is told apart here by the kernel itself (a shadow
cache the request alone writes), not by the code under test.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from connector.config.loading import load_config
from connector.engine.facts import EngineFacts
from connector.engine.jobs import CPU, DISK, ChunkLoad, LoadJob, StepPlan, StoreJob
from connector.engine.pd_jobs import PDSendChunk, PDSendJob
from connector.vllm_compat import kv_block_slots
from connector.worker.connector_worker import ConnectorWorker
from connector.worker.kv_blocks import BlockCopier
from connector.worker.pd_worker import PDSends
from connector.worker.tail_slots import TailSlots

ops = pytest.importorskip("vllm._custom_ops")
cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")

LAYERS, NUM_BLOCKS, HEADS, BS, CHUNK = 3, 8, 2, 128, 256
OLD, FULL, OWN = 1, (0, 5), (2, 4)  # blocks: the other prompt's; a full chunk's; the tail chunk's
TAIL = OWN[-1]  # the block the prompt ends in, the other prompt's before
LOAD_INTO = (6, 3)  # where a stored tail chunk is loaded back

# head 64 -> "vec" (or "amx" with AMX and bf16), head 48 -> "vec16"
CASES = [(h, d, n) for h in (64, 48) for d in (torch.bfloat16, torch.float32) for n in (1, BS - 1)]


def isa(head: int, dtype: torch.dtype) -> str:
    return cpu_attn._get_attn_isa(dtype, BS, head, "auto")


def engine_config(dtype: torch.dtype) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(dtype=dtype), cache_config=SimpleNamespace(cache_dtype="auto")
    )


def caches(head: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """vLLM's CPU layout: every layer a ``[blocks, heads, block_size, 2*head]`` view of one storage."""
    storage = torch.zeros(LAYERS, NUM_BLOCKS, HEADS, BS, 2 * head, dtype=dtype)
    return {f"model.layers.{i}.self_attn.attn": storage[i] for i in range(LAYERS)}


def write(kv: torch.Tensor, blocks: tuple[int, ...], tokens: int, seed: int) -> None:
    """Write ``tokens`` tokens' K and V (non-zero) into ``blocks`` through vLLM's CPU kernel."""
    _, heads, block_size, width = kv.shape
    gen = torch.Generator().manual_seed(seed)
    key, value = (torch.randn(tokens, heads, width // 2, generator=gen) for _ in range(2))
    key, value = (t.masked_fill(t == 0, 1.0).to(kv.dtype) for t in (key, value))
    slots = torch.tensor([blocks[t // block_size] * block_size + t % block_size for t in range(tokens)])
    key_cache, value_cache = kv.view(kv.shape[0], heads, 2 * block_size, -1).chunk(2, dim=2)
    kernel_isa = isa(width // 2, kv.dtype)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, kernel_isa, 1.0, 1.0, "auto")


def as_int(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def prefill(kvs: dict[str, torch.Tensor], n: int) -> tuple[list[torch.Tensor], int]:
    """Another prompt fills blocks OLD and TAIL, then is gone; the request's prompt of
    ``CHUNK + BS + n`` tokens is written into FULL + OWN. Returns, per layer, which elements of
    TAIL the request wrote (as the kernel alone says: a shadow cache only it writes), and the
    prompt's length."""
    prompt = CHUNK + BS + n
    written = []
    for i, kv in enumerate(kvs.values()):
        write(kv, (OLD, TAIL), 2 * BS, seed=100 + i)
        write(kv, FULL + OWN, prompt, seed=i)
        shadow = torch.zeros_like(kv)
        write(shadow, FULL + OWN, prompt, seed=i)
        written.append(as_int(shadow[TAIL]) != 0)
    return written, prompt


def assert_only_own_slots(got: torch.Tensor, kv: torch.Tensor, own: torch.Tensor, layer: int) -> None:
    """``got`` (a block of ``kv``'s shape) holds the request's bytes of TAIL and zeros elsewhere."""
    got, cache = as_int(got), as_int(kv[TAIL])
    assert bool((cache[~own] != 0).any()), "the block holds the other prompt's KV"
    assert torch.equal(got[own], cache[own]), f"layer {layer}: the request's own bytes changed"
    assert bool((got[~own] == 0).all()), f"layer {layer}: another prompt's KV leaves the worker"


class FakeSender:
    def __init__(self) -> None:
        self.transfers: list = []

    def send(self, transfer) -> None:
        self.transfers.append(transfer)

    def close(self, timeout_s: float) -> None:
        pass


def pd_send(kvs, prompt: int, tails: TailSlots | None) -> list[tuple[str, np.ndarray, int]]:
    """What a PDSends hands its sender for a prompt of a full chunk and an unfull one."""
    copier = BlockCopier(kvs, NUM_BLOCKS)
    sender = FakeSender()
    sends = PDSends(0, lambda space: sender, lambda **kw: SimpleNamespace(**kw), None, 1 << 30)
    sends.tails = tails
    chunks = (PDSendChunk("k0", FULL, CHUNK), PDSendChunk("k1", OWN, prompt - CHUNK))
    job = PDSendJob("q", "proxy-q", "127.0.0.1", (7300,), (7400,), chunks, "space", False)
    sends.run([job], copier.gather, set())
    (transfer,) = sender.transfers
    sends.close(1.0)
    return [
        (key, np.frombuffer(view, dtype=np.uint8).reshape(LAYERS, -1, copier.block_bytes), tokens)
        for key, view, tokens in transfer.chunks
    ]


def block_of(payload: np.ndarray, layer: int, position: int, kv: torch.Tensor) -> torch.Tensor:
    """Block ``position`` of a payload's layer as a block of ``kv``."""
    return torch.from_numpy(payload[layer, position].copy()).view(kv.dtype).view(kv.shape[1:])


@pytest.mark.parametrize(("head", "dtype", "n"), CASES, ids=lambda v: str(v).removeprefix("torch."))
def test_pd_sender_gets_zeros_past_the_prompt_in_its_last_block(head, dtype, n):
    kvs = caches(head, dtype)
    written, prompt = prefill(kvs, n)
    first = next(iter(kvs.values()))
    tails = TailSlots.of(BlockCopier(kvs, NUM_BLOCKS), BS, kv_block_slots(engine_config(dtype), first))
    (k0, full, _), (k1, tail, tokens) = pd_send(kvs, prompt, tails)
    assert (k0, k1, tokens) == ("k0", "k1", BS + n)
    for i, kv in enumerate(kvs.values()):
        for position, b in enumerate(FULL):  # whole blocks go out as they are
            assert torch.equal(block_of(full, i, position, kv), kv[b])
        assert torch.equal(block_of(tail, i, 0, kv), kv[OWN[0]])
        assert_only_own_slots(block_of(tail, i, 1, kv), kv, written[i], i)
    assert int((~written[0]).sum()) == first[0].numel() * (BS - n) // BS  # slots n.. are that share


def test_the_two_head_sizes_take_two_packings_of_the_kernel():
    """The cases above cover two ISAs (vec, or amx with AMX and bf16; and vec16) on this machine."""
    assert isa(64, torch.float32) != isa(48, torch.float32) == "vec16"


def test_an_unknown_packing_sends_the_whole_chunks_only():
    kvs = caches(64, torch.bfloat16)
    _, prompt = prefill(kvs, 5)
    chunks = pd_send(kvs, prompt, TailSlots(BS))
    assert [(key, tokens) for key, _, tokens in chunks] == [("k0", CHUNK)]


def worker(kvs, tmp_path, dtype, probe=True) -> ConnectorWorker:
    """A worker storing exact unfull chunks (``save_unfull_chunk``) in its CPU and disk tiers."""
    copier = BlockCopier(kvs, NUM_BLOCKS)
    facts = EngineFacts("m", str(dtype), BS, LAYERS, copier.block_bytes, "layout", 1, "kv_both")
    config = {
        "lmcache.chunk_size": CHUNK,
        "lmcache.save_unfull_chunk": True,
        "lmcache.local_disk": str(tmp_path),
        "lmcache.max_local_disk_size": 1,
    }
    w = ConnectorWorker(load_config(config, env={}), facts, rank=0)
    w.register(kvs, NUM_BLOCKS, (lambda kv: kv_block_slots(engine_config(dtype), kv)) if probe else None)
    return w


@pytest.mark.parametrize("n", [1, BS - 1])
def test_an_exact_unfull_chunk_is_stored_in_every_tier_with_zeros_past_the_prompt(tmp_path, n):
    kvs = caches(64, torch.bfloat16)
    written, prompt = prefill(kvs, n)
    w = worker(kvs, tmp_path, torch.bfloat16)
    name = "ab" * 16
    assert w.save(StepPlan(writes=[StoreJob("a", name, OWN, (CPU, DISK), prompt - CHUNK)])) == []
    assert w.flush()
    for tier in (CPU, DISK):  # loaded back: the disk record checks out over the zeroed bytes
        for kv in kvs.values():
            kv[list(LOAD_INTO)] = 0
        chunk = ChunkLoad(name, tier, LOAD_INTO, 0, prompt - CHUNK)
        w.load(StepPlan(loads=[LoadJob(f"b-{tier}", (chunk,))]))
        assert w.take_failed_blocks() == set()
        for i, kv in enumerate(kvs.values()):
            assert torch.equal(kv[LOAD_INTO[0]], kv[OWN[0]])
            assert_only_own_slots(kv[LOAD_INTO[1]], kv, written[i], i)
    w.shutdown()


def test_an_unfull_chunk_is_not_stored_where_the_packing_is_unknown(tmp_path):
    kvs = caches(64, torch.bfloat16)
    _, prompt = prefill(kvs, 5)
    w = worker(kvs, tmp_path, torch.bfloat16, probe=False)
    whole, unfull = (
        StoreJob("a", "cd" * 16, FULL, (CPU,), CHUNK),
        StoreJob("a", "ab" * 16, OWN, (CPU,), prompt - CHUNK),
    )
    failures = w.save(StepPlan(writes=[whole, unfull]))
    assert [(f.name, f.tier) for f in failures] == [(unfull.name, CPU)]
    w.shutdown()
