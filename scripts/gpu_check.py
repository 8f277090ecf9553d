"""KVLens's CUDA copy path, checked on a GPU in one run (torch only; vLLM is not needed).

    python scripts/gpu_check.py            # on a machine with CUDA: every check, under 5 minutes
    python scripts/gpu_check.py --cpu      # what runs without CUDA (CI runs this)

Builds KV caches shaped as vLLM 0.32 lays them out on GPU (``[num_blocks, kv_heads,
block_size, 2*head_size]`` per layer, in every ``KVCacheLayout`` stride permutation, and the
older K/V-first shape), and moves blocks through the code the connector runs
(``BlockCopier``, ``StepCopies``, ``CudaCopyStream``):

- round trip: random and consecutive blocks gathered into page-locked host payloads and
  loaded into other blocks, layer by layer, bit for bit (random bits, NaN patterns included);
- no host synchronisation: the step's hooks return while the GPU is still busy, under
  ``torch.cuda.set_sync_debug_mode("error")``;
- ordering: each layer's reader waits for that layer's load even when the copies are late;
- GB/s: device-to-host and host-to-device against torch's own page-locked copies;
- overlap: a layer-wise load beside a stream of matmuls, against each alone;
- the worker: a store and a load through ``ConnectorWorker`` (when its packages are there).

Prints PASS / FAIL / SKIP per check and a GB/s table; exits 1 if any check failed. Without
CUDA it runs the CPU checks and exits 0 when they pass.
"""

from __future__ import annotations

import argparse
import faulthandler
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from connector.worker.kv_blocks import BlockCopier  # noqa: E402
from connector.worker.layer_copies import BlockGather, BlockLoad, CopyThread, StepCopies  # noqa: E402

# stride order of logical [L, B, H, N, C] (vllm/v1/kv_cache_layout.py)
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),  # vLLM's default on GPU (FlashAttention declares no preference)
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


@dataclass(frozen=True)
class Shape:
    layers: int
    blocks: int
    heads: int = 8
    block_size: int = 16
    head_size: int = 128

    @property
    def block_bytes(self) -> int:
        return self.heads * self.block_size * 2 * self.head_size * 2  # bf16


@dataclass
class Outcome:
    name: str
    status: str  # PASS, FAIL, SKIP
    detail: str


class Checks:
    """Runs checks in order within one time budget; a check that raises fails."""

    def __init__(self, budget_s: float) -> None:
        self.deadline = time.monotonic() + budget_s
        self.outcomes: list[Outcome] = []
        self.rates: list[tuple[str, float, float]] = []  # (what, KVLens GB/s, torch GB/s)

    def run(self, name: str, check: Callable[[], tuple[bool, str]], needs_s: float) -> None:
        left = self.deadline - time.monotonic()
        if left < needs_s:
            self._record(
                Outcome(name, "FAIL", f"not run: {left:.0f} s of the budget left, needs ~{needs_s:.0f}")
            )
            return
        started = time.monotonic()
        try:
            ok, detail = check()
            outcome = Outcome(name, "PASS" if ok else "FAIL", detail)
        except Skip as e:
            outcome = Outcome(name, "SKIP", str(e))
        except Exception as e:  # noqa: BLE001 - a check that raises has failed; say where
            where = traceback.extract_tb(e.__traceback__)[-1]
            outcome = Outcome(
                name, "FAIL", f"{type(e).__name__}: {e} ({os.path.basename(where.filename)}:{where.lineno})"
            )
        self._record(outcome, time.monotonic() - started)

    def _record(self, outcome: Outcome, seconds: float = 0.0) -> None:
        self.outcomes.append(outcome)
        print(f"{outcome.status:4}  {outcome.name}: {outcome.detail}  [{seconds:.1f} s]", flush=True)

    @property
    def failed(self) -> bool:
        return any(o.status == "FAIL" for o in self.outcomes)


class Skip(Exception):
    pass


# ---- KV caches as vLLM lays them out ----------------------------------------------------------
def random_bits(shape: tuple[int, ...], device: torch.device, seed: int) -> torch.Tensor:
    """bf16 tensor of random bit patterns (NaNs and all: the copy must be bit-exact)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    bits = torch.randint(-(2**15), 2**15, shape, dtype=torch.int32, device=device, generator=gen)
    return bits.to(torch.int16).view(torch.bfloat16)


def kv_caches(shape: Shape, layout: str, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """Per-layer logical ``[blocks, heads, block_size, 2*head]`` views of one storage in ``layout``."""
    if layout == "KV-first":  # older flash-attn: [2, blocks, block_size, heads, head] per layer
        full = (shape.layers, 2, shape.blocks, shape.block_size, shape.heads, shape.head_size)
        storage = random_bits(full, device, seed)
        return {f"model.layers.{i}.self_attn.attn": storage[i] for i in range(shape.layers)}
    order = LAYOUTS[layout]
    logical = (shape.layers, shape.blocks, shape.heads, shape.block_size, 2 * shape.head_size)
    physical = random_bits(tuple(logical[d] for d in order), device, seed)
    as_logical = physical.permute(*(order.index(d) for d in range(5)))
    return {f"model.layers.{i}.self_attn.attn": as_logical[i] for i in range(shape.layers)}


def block_axis(kv: torch.Tensor, shape: Shape) -> int:
    return 1 if kv.shape[0] == 2 and kv.dim() == 5 else 0


def blocks_of(kv: torch.Tensor, ids: list[int], shape: Shape) -> torch.Tensor:
    """Blocks ``ids`` in logical order, as int16 (compared bit for bit)."""
    idx = torch.tensor(ids, device=kv.device)
    return kv.index_select(block_axis(kv, shape), idx).contiguous().view(torch.int16)


def in_memory_order(kv: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """Blocks ``ids`` of a block-first tensor as their bytes lie in memory (a payload's rows)."""
    inner = kv[0]
    order = sorted(range(inner.dim()), key=lambda d: -inner.stride(d))
    return torch.stack([kv[b].permute(*order).contiguous() for b in ids]).view(torch.int16).view(len(ids), -1)


def runner_for(device: torch.device):
    if device.type == "cuda":
        from connector.worker.cuda_copies import CudaCopyStream, TorchCuda

        return CudaCopyStream(TorchCuda(device))
    return CopyThread()


def gather_step(
    copier: BlockCopier, runner, ids: list[int], names: list[str], out: torch.Tensor | None = None
) -> tuple[StepCopies, torch.Tensor]:
    """Gather ``ids`` as the worker does: layer by layer as each is saved; the bytes once ready."""
    step = StepCopies("check", copier, runner)
    out = copier.new_payload(len(ids)) if out is None else out
    step.gathers = {0: BlockGather(out, ids, copier.gather_pairs(out, ids))}
    for name in names:
        step.gather_layer(name)
    step.finish_gathers()
    return step, out


def load_step(
    copier: BlockCopier, runner, payload: torch.Tensor, ids: list[int], names: list[str]
) -> StepCopies:
    """Load ``payload`` into ``ids`` as the worker does: every layer queued, each awaited in turn."""
    step = StepCopies("check", copier, runner)
    step.start_loads([BlockLoad(payload, ids, 0, copier.load_pairs(payload, ids, 0))])
    for name in names:
        step.wait_layer(name)
    step.wait_all()
    return step


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- the checks -------------------------------------------------------------------------------
def check_round_trip(layout: str, shape: Shape, device: torch.device) -> tuple[bool, str]:
    src, dst = kv_caches(shape, layout, device, 1), kv_caches(shape, layout, device, 2)
    names = list(src)
    cs, cd = BlockCopier(src, shape.blocks), BlockCopier(dst, shape.blocks)
    runner = runner_for(device)
    gen = torch.Generator().manual_seed(3)
    perm = torch.randperm(shape.blocks, generator=gen).tolist()
    n = min(40, shape.blocks // 4)
    cases = {
        "scattered": (perm[:n], perm[n : 2 * n]),
        "consecutive": (list(range(5, 5 + n)), list(range(shape.blocks - n - 3, shape.blocks - 3))),
    }
    problems = []
    try:
        for case, (from_ids, to_ids) in cases.items():
            before = {name: dst[name].clone() for name in names}
            step, payload = gather_step(cs, runner, from_ids, names)
            step.wait_gathers()
            if step.stalled or step.gathers[0].error:
                problems.append(f"{case}: gather failed: {step.stalled or step.gathers[0].error}")
                continue
            if device.type == "cuda" and not payload.is_pinned():
                problems.append(f"{case}: the payload is not page-locked")
            # as the CPU tier holds it (a memoryview), and as a disk or remote read gives it (pageable)
            held = cd.payload_view(memoryview(payload.numpy()).cast("B"))
            read = cd.payload_view(memoryview(bytearray(payload.numpy().tobytes())))
            if device.type == "cuda" and not held[:, :1].is_pinned():
                problems.append(f"{case}: a view of the CPU tier's page-locked buffer is not seen as such")
            for source, payload_in in (("held", held), ("read", read)):
                step = load_step(cd, runner, payload_in, to_ids, names)
                synchronize(device)
                if any(load.error for load in step.loads):
                    problems.append(f"{case}/{source}: load failed: {step.loads[0].error}")
                    continue
                for name in names:
                    kv = dst[name]
                    if not torch.equal(blocks_of(kv, to_ids, shape), blocks_of(src[name], from_ids, shape)):
                        problems.append(f"{case}/{source}: {name} blocks differ")
                        break
                    rest = [i for i in range(shape.blocks) if i not in set(to_ids)]
                    if not torch.equal(blocks_of(kv, rest, shape), blocks_of(before[name], rest, shape)):
                        problems.append(f"{case}/{source}: {name} blocks outside the load changed")
                        break
    finally:
        runner.close()
    rows = "rows" if cs.rows else "indexed"
    detail = f"{shape.layers} layers, {n} scattered + {n} consecutive blocks, {rows} copies"
    return not problems, ("bit-exact; " + detail) if not problems else "; ".join(problems[:4])


def check_no_sync(shape: Shape, device: torch.device) -> tuple[bool, str]:
    """The step's hooks queue work and return while the GPU is busy, with no synchronising call."""
    caches = kv_caches(shape, "LBNHC", device, 4)
    names = list(caches)
    copier = BlockCopier(caches, shape.blocks)
    runner = runner_for(device)
    payload = copier.gather(list(range(0, 32)))  # a page-locked payload, as the CPU tier holds
    expected = {name: in_memory_order(caches[name], list(range(100, 132))) for name in names}
    out = copier.new_payload(32)
    busy_s = 0.5
    cycles = cycles_per_second(device) * busy_s
    torch.cuda.synchronize(device)
    torch.cuda._sleep(int(cycles))  # the forward pass's stream is busy for ~busy_s
    torch.cuda.set_sync_debug_mode("error")
    try:
        started = time.perf_counter()
        step = StepCopies("check", copier, runner)
        step.start_loads([BlockLoad(payload, list(range(200, 232)), 0)])
        step.gathers = {0: BlockGather(out, list(range(100, 132)))}
        for name in names:
            step.wait_layer(name)
            step.gather_layer(name)
        step.finish_gathers()
        host_s = time.perf_counter() - started
        ready_at_once = step.gathers_ready()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    step.wait_gathers()
    torch.cuda.synchronize(device)
    runner.close()
    gathered_ok = all(
        torch.equal(out[i].view(torch.int16).cpu(), expected[name].cpu()) for i, name in enumerate(names)
    )
    loaded_ok = all(
        torch.equal(
            blocks_of(caches[name], list(range(200, 232)), shape),
            blocks_of(caches[name], list(range(32)), shape),
        )
        for name in names
    )
    ok = host_s < busy_s / 4 and not ready_at_once and gathered_ok and loaded_ok
    return ok, (
        f"hooks took {host_s * 1e3:.1f} ms of host time while the GPU was busy for {busy_s * 1e3:.0f} ms; "
        f"gathers ready before the GPU got there: {ready_at_once}; bytes right: {gathered_ok and loaded_ok}"
    )


def check_ordering(shape: Shape, device: torch.device) -> tuple[bool, str]:
    """Each layer's reader, queued right after ``wait_layer``, sees that layer's load even when
    the copy stream is held back; one queued without the wait does not (so the wait matters)."""
    caches = kv_caches(shape, "LBNHC", device, 5)
    names = list(caches)
    copier = BlockCopier(caches, shape.blocks)
    runner = runner_for(device)
    source, target = list(range(0, 24)), list(range(300, 324))
    payload = copier.gather(source)
    expected = torch.stack([blocks_of(caches[n], source, shape).to(torch.int64).sum() for n in names])
    idx = torch.tensor(target, device=device)
    for name in names:
        for b in target:
            caches[name][b].zero_()
    with torch.cuda.stream(runner.stream):
        torch.cuda._sleep(int(cycles_per_second(device) * 0.2))  # late copies
    step = StepCopies("check", copier, runner)
    step.start_loads([BlockLoad(payload, target, 0)])
    unawaited = caches[names[-1]].index_select(0, idx).view(torch.int16).to(torch.int64).sum()
    seen = torch.zeros(len(names), dtype=torch.int64, device=device)
    for i, name in enumerate(names):
        step.wait_layer(name)
        seen[i] = caches[name].index_select(0, idx).view(torch.int16).to(torch.int64).sum()
    torch.cuda.synchronize(device)
    runner.close()
    ok = torch.equal(seen, expected)
    return ok, (
        f"{len(names)} layers each saw its own load: {ok}; a reader that did not wait saw "
        + (
            "the old bytes"
            if int(unawaited) == 0
            else "the new bytes (the copies were not late enough to tell)"
        )
    )


def cycles_per_second(device: torch.device) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / (start.elapsed_time(end) / 1e3)


def best_s(fn: Callable[[], None], device: torch.device, repeats: int = 3) -> float:
    best = math.inf
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best


def check_bandwidth(
    checks: Checks, shape: Shape, chunk_blocks: int, device: torch.device
) -> tuple[bool, str]:
    """GB/s of KVLens's gathers and loads against torch copying the same bytes in one piece."""
    caches = kv_caches(shape, "LBNHC", device, 6)
    names = list(caches)
    copier = BlockCopier(caches, shape.blocks)
    runner = runner_for(device)
    nbytes = copier.payload_nbytes(chunk_blocks)
    gen = torch.Generator().manual_seed(7)
    cases = {
        "consecutive": (list(range(chunk_blocks)), list(range(chunk_blocks, 2 * chunk_blocks))),
        "scattered": tuple(
            torch.randperm(shape.blocks, generator=gen)[: 2 * chunk_blocks].split(chunk_blocks)
        ),
    }
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = copier.new_payload(chunk_blocks)  # page-locked on CUDA
    out = copier.new_payload(chunk_blocks)  # reused, as the worker reuses dropped buffers
    pageable = torch.empty(host.shape, dtype=torch.uint8)
    pageable.copy_(host)
    torch_d2h = nbytes / best_s(lambda: host.view(-1).copy_(on_device, non_blocking=True), device) / 1e9
    torch_h2d = nbytes / best_s(lambda: on_device.copy_(host.view(-1), non_blocking=True), device) / 1e9
    torch_h2d_pageable = (
        nbytes / best_s(lambda: on_device.copy_(pageable.view(-1), non_blocking=True), device) / 1e9
    )
    low = []
    try:
        for case, (from_ids, to_ids) in cases.items():
            from_ids, to_ids = [int(b) for b in from_ids], [int(b) for b in to_ids]

            def store(ids: list[int] = from_ids) -> None:
                step, _ = gather_step(copier, runner, ids, names, out)
                step.wait_gathers()

            def load(payload: torch.Tensor = host, ids: list[int] = to_ids) -> None:
                load_step(copier, runner, payload, ids, names)

            rows = [
                (f"device->host {case} (store)", nbytes / best_s(store, device) / 1e9, torch_d2h, True),
                (
                    f"host->device {case} (load, page-locked)",
                    nbytes / best_s(load, device) / 1e9,
                    torch_h2d,
                    True,
                ),
            ]
            if case == "consecutive":
                rate = nbytes / best_s(lambda: load(pageable), device) / 1e9
                rows.append(
                    (f"host->device {case} (load, pageable: disk/remote)", rate, torch_h2d_pageable, False)
                )
            for what, ours, theirs, counted in rows:
                checks.rates.append((what, ours, theirs))
                if counted and device.type == "cuda" and ours < 0.5 * theirs:
                    low.append(what)
    finally:
        runner.close()
    size = f"{nbytes / 2**20:.1f} MiB chunks ({shape.layers} layers x {chunk_blocks} blocks)"
    if device.type != "cuda":
        return True, f"{size}; figures only (no bar on CPU)"
    return (
        not low,
        f"{size}; at least half of torch's page-locked copy" if not low else f"below half of torch's: {low}",
    )


def check_overlap(shape: Shape, chunk_blocks: int, device: torch.device) -> tuple[bool, str]:
    """Loading layer by layer beside a matmul per layer takes about the longer of the two."""
    caches = kv_caches(shape, "LBNHC", device, 8)
    names = list(caches)
    copier = BlockCopier(caches, shape.blocks)
    runner = runner_for(device)
    source, target = list(range(chunk_blocks)), list(range(chunk_blocks, 2 * chunk_blocks))
    payload = copier.gather(source)
    expected = torch.stack([blocks_of(caches[n], source, shape).to(torch.int64).sum() for n in names])
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device=device)
    b = torch.randn(4096, 4096, dtype=torch.bfloat16, device=device)
    c = torch.empty_like(a)
    idx = torch.tensor(target, device=device)
    seen = torch.zeros(len(names), dtype=torch.int64, device=device)
    one_matmul = best_s(lambda: torch.matmul(a, b, out=c), device, 5)
    load_s = best_s(lambda: load_step(copier, runner, payload, target, names), device)
    reps = max(1, round(load_s / len(names) / one_matmul))

    def compute() -> None:
        for _ in names:
            for _ in range(reps):
                torch.matmul(a, b, out=c)

    def both() -> None:
        step = StepCopies("check", copier, runner)
        step.start_loads([BlockLoad(payload, target, 0)])
        for i, name in enumerate(names):
            step.wait_layer(name)
            for _ in range(reps):
                torch.matmul(a, b, out=c)
            seen[i] = caches[name].index_select(0, idx).view(torch.int16).to(torch.int64).sum()
        step.wait_all()

    compute_s = best_s(compute, device)
    both_s = best_s(both, device)
    runner.close()
    hidden = (compute_s + load_s - both_s) / min(compute_s, load_s)
    right = torch.equal(seen, expected)
    return hidden >= 0.5 and right, (
        f"load {load_s * 1e3:.1f} ms, matmuls {compute_s * 1e3:.1f} ms ({reps} per layer), together "
        f"{both_s * 1e3:.1f} ms: {hidden:.0%} of the shorter hidden; each layer read its load: {right}"
    )


def check_worker(shape: Shape, device: torch.device) -> tuple[bool, str]:
    """A store then a load through ``ConnectorWorker`` with the CPU tier, as the connector runs them."""
    try:
        from connector.config.loading import load_config
        from connector.engine.facts import EngineFacts
        from connector.engine.jobs import CPU, ChunkLoad, LoadJob, StepPlan, StoreJob
        from connector.worker.connector_worker import ConnectorWorker
    except ImportError as e:
        raise Skip(f"the worker's packages are not installed here ({e})") from e
    caches = kv_caches(shape, "LBNHC", device, 9)
    names = list(caches)
    copier = BlockCopier(caches, shape.blocks)
    facts = EngineFacts(
        "m", "bf16", shape.block_size, shape.layers, copier.block_bytes, "check", 1, "kv_both"
    )
    w = ConnectorWorker(load_config({"lmcache.chunk_size": 16 * shape.block_size}, env={}), facts, rank=0)
    w.register(caches, shape.blocks)
    q = shape.blocks // 4
    source, target, name = tuple(range(q, q + 16)), tuple(range(2 * q, 2 * q + 16)), "ab" * 16
    expected = {n: blocks_of(caches[n], list(source), shape).clone() for n in names}
    try:
        plan = StepPlan(writes=[StoreJob("a", name, source, (CPU,), 16 * shape.block_size)])
        w.start_load(plan)
        for n in names:
            w.wait_layer(n)
            w.save_layer(plan, n)
        w.finish_load()
        w.save(plan)
        deadline = time.monotonic() + 10
        while len(w.tiers[CPU]) == 0 and time.monotonic() < deadline:  # written once copied out
            w.take_report()
            time.sleep(0.001)
        if len(w.tiers[CPU]) == 0:
            return False, "the store never reached the CPU tier"
        plan = StepPlan(loads=[LoadJob("b", (ChunkLoad(name, CPU, target, 0, 16 * shape.block_size),))])
        w.start_load(plan)
        for n in names:
            w.wait_layer(n)
        (outcome,) = w.finish_load()
        w.save(plan)
        synchronize(device)
        right = all(torch.equal(blocks_of(caches[n], list(target), shape), expected[n]) for n in names)
        runner = type(w.runner).__name__
        return (
            not outcome.failed and right,
            f"runner {runner}; load failed: {outcome.failed}; bytes right: {right}",
        )
    finally:
        w.shutdown()


def print_rates(rates: list[tuple[str, float, float]]) -> None:
    if not rates:
        return
    width = max(len(what) for what, _, _ in rates)
    print(f"\n{'GB/s':<{width}}  {'KVLens':>8}  {'torch':>8}  {'ratio':>6}")
    for what, ours, theirs in rates:
        print(f"{what:<{width}}  {ours:8.2f}  {theirs:8.2f}  {ours / theirs:6.2f}")
    print()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run the CPU checks even where CUDA is available")
    parser.add_argument("--budget-s", type=float, default=240.0, help="time for every check together")
    args = parser.parse_args(argv)
    # a hung wait ends the run (with every thread's stack) instead of outlasting the machine
    faulthandler.dump_traceback_later(args.budget_s + 40, exit=True, file=sys.__stderr__)
    started = time.monotonic()
    cuda = torch.cuda.is_available() and not args.cpu
    checks = Checks(args.budget_s)
    if cuda:
        device = torch.device("cuda", torch.cuda.current_device())
        props = torch.cuda.get_device_properties(device)
        print(
            f"KVLens GPU check: torch {torch.__version__}, CUDA {torch.version.cuda}, {props.name}, "
            f"{props.total_memory / 2**30:.0f} GiB\n",
            flush=True,
        )
        small = Shape(layers=4, blocks=512)
        for layout in [*LAYOUTS, "KV-first"]:
            checks.run(
                f"round trip {layout}", lambda layout=layout: check_round_trip(layout, small, device), 5
            )
        checks.run("no host synchronisation on the step path", lambda: check_no_sync(small, device), 5)
        checks.run(
            "each layer waits for its own load",
            lambda: check_ordering(Shape(layers=8, blocks=512), device),
            5,
        )
        model = Shape(layers=32, blocks=1024)  # an 8B model's KV shape: 64 KiB per layer-block
        checks.run("GB/s against torch", lambda: check_bandwidth(checks, model, 192, device), 30)
        checks.run("layer-wise load overlaps a matmul stream", lambda: check_overlap(model, 192, device), 30)
        checks.run("worker store and load", lambda: check_worker(Shape(layers=4, blocks=256), device), 10)
    else:
        device = torch.device("cpu")
        print("KVLens GPU check: no CUDA here; running the CPU checks of the same copy path\n", flush=True)
        tiny = Shape(layers=2, blocks=64, heads=2, head_size=16)
        for layout in [*LAYOUTS, "KV-first"]:
            checks.run(
                f"round trip {layout} (CPU)", lambda layout=layout: check_round_trip(layout, tiny, device), 2
            )
        checks.run("GB/s against torch (CPU)", lambda: check_bandwidth(checks, tiny, 16, device), 2)
        checks.run("worker store and load (CPU)", lambda: check_worker(tiny, device), 2)
        for name in (
            "no host synchronisation on the step path",
            "each layer waits for its own load",
            "overlap",
        ):
            checks._record(Outcome(name, "SKIP", "needs CUDA"))
    print_rates(checks.rates)
    counts = {s: sum(o.status == s for o in checks.outcomes) for s in ("PASS", "FAIL", "SKIP")}
    verdict = "FAIL" if checks.failed else "PASS"
    print(
        f"RESULT: {verdict} ({counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped) "
        f"in {time.monotonic() - started:.0f} s on {'CUDA' if cuda else 'CPU only'}"
    )
    faulthandler.cancel_dump_traceback_later()
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
