"""A ``vllm serve`` at KVLens's default settings with a disk tier, killed with SIGKILL (API
server, engine core and workers at once) right after a burst of requests, while disk writes may
still be queued, then started again on the same ``local_disk``. What was stored before the kill
is served from disk with the cold outputs, and whatever the kill left half-written is never read
(no load fails, outputs identical). On the restarted engine every request hits, so no step is a
cold prefill: it still measures what a prefill token costs (checked against the wall clock), and
the bytes it reads from disk match vLLM's own count of disk-cached tokens and the chunk files.
Last, the restarted engine goes idle after a burst of writes: it then uses no CPU.
One killed-and-restarted pair serves every test here (two vLLM starts)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from connector.tiers import codec
from connector.tiers.disk import chunk_files

from ..telemetry.serve import (
    VllmServer,
    base_env,
    kv_transfer_config,
    prompt_tokens,
    sample,
    sum_samples,
    wait_until,
)

pytestmark = pytest.mark.integration

ARGS = ("--dtype", "float32")  # greedy outputs compared bit for bit
STORED = [prompt_tokens(700, 400 + i) for i in range(3)]  # 2 chunks + a 128-token block: 640
BURST = [prompt_tokens(900, 500 + i) for i in range(8)]
CHUNK = 256  # KVLens's default chunk_size
PREFIXES = [prompt_tokens(CHUNK * (2 + i % 2), 700 + i) for i in range(14)]  # 2 or 3 whole chunks
PER_TOKEN = "vllm:kvlens_prefill_seconds_per_token"


def serve(tiny_model: str, disk: Path, log: Path) -> VllmServer:
    kv = kv_transfer_config(local_disk=str(disk), max_local_disk_size=1)  # defaults besides the disk
    srv = VllmServer(tiny_model, kv, log, base_env(KVLENS_EVENT_LOG=str(log.parent / "events.jsonl")), ARGS)
    srv.wait_ready()
    return srv


def text(response) -> str:
    return response["choices"][0]["text"]


def loaded(response) -> dict:
    return response["kv_transfer_params"]["kvlens"]["loaded_tokens"]


def burst(srv: VllmServer) -> dict[int, str]:
    """The burst's prompts at once; returns the outputs of those that completed."""
    done: dict[int, str] = {}

    def one(i: int) -> None:
        try:
            done[i] = text(srv.complete(BURST[i], max_tokens=8))
        except Exception:  # the server may be killed under it
            pass

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(BURST))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return done


@pytest.fixture(scope="module")
def restarted(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("warm")
    disk = tmp / "kv"
    first = serve(tiny_model, disk, tmp / "first.log")
    try:
        cold = [text(first.complete(p, max_tokens=8)) for p in STORED]
        for p in PREFIXES:
            first.complete(p, max_tokens=1)
        wait_until(lambda: sample(first.samples(), "vllm:kvlens_pending_writes") == 0, what="writes landed")
        burst_cold = burst(first)
        os.killpg(first.proc.pid, signal.SIGKILL)  # no shutdown: queued writes die with it
        first.proc.wait(timeout=30)
    finally:
        first.stop()
    # What a kill mid-write leaves: a temp file with half a chunk (never to be read).
    some = Path(chunk_files(str(disk))[0])
    half = some.read_bytes()
    (some.parent / ".tmp-killed-mid-write").write_bytes(half[: len(half) // 2])
    files_before = {f for _, _, names in os.walk(disk) for f in names}
    second = serve(tiny_model, disk, tmp / "second.log")
    try:
        warm = [second.complete(p, max_tokens=8) for p in STORED]
        burst_warm = {i: second.complete(BURST[i], max_tokens=8) for i in burst_cold}
        yield {
            "cold": cold,
            "warm": warm,
            "burst_cold": burst_cold,
            "burst_warm": burst_warm,
            "samples": second.samples(),
            "files_before": files_before,
            "server": second,
            "disk": disk,
        }
    finally:
        second.stop()


def test_prefixes_stored_before_the_kill_are_served_from_disk(restarted):
    for resp in restarted["warm"]:
        assert loaded(resp) == {"disk": 640}


def test_outputs_after_the_restart_are_the_cold_outputs(restarted):
    assert [text(r) for r in restarted["warm"]] == restarted["cold"]
    assert restarted["burst_cold"], "some of the burst completed before the kill"
    for i, resp in restarted["burst_warm"].items():
        assert text(resp) == restarted["burst_cold"][i]


def test_what_the_kill_left_half_written_is_never_read(restarted):
    s = restarted["samples"]
    assert ".tmp-killed-mid-write" in restarted["files_before"]
    assert sum_samples(s, "vllm:kvlens_failed_blocks_total") == 0
    assert sum_samples(s, "vllm:kvlens_failed_load_requests_total") == 0
    assert sum_samples(s, "vllm:kvlens_failed_chunks_total", operation="load") == 0


def whole_chunk_bytes(disk) -> int:
    """The payload a whole chunk's record on disk declares (the largest record's)."""
    return max(codec.read_header(path.read_bytes()).nbytes for path in disk.rglob("*.kvlens"))


def plain_read_speed(disk) -> float:
    """Bytes per second reading every chunk file whole, best of three passes (page cache warm)."""
    files = list(disk.rglob("*.kvlens"))
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        nbytes = sum(len(f.read_bytes()) for f in files)
        best = min(best, time.perf_counter() - started)
    return nbytes / best


def cold_seconds_per_token(srv) -> float:
    """The wall clock's marginal cost of a prefill token: the latency difference between new
    prompts of two lengths (client overhead cancels), best of three each."""
    best = {}
    for n in (400, 1600):
        times = []
        for k in range(3):
            started = time.monotonic()
            srv.complete(prompt_tokens(n, 5000 + 10 * n + k), max_tokens=1)
            times.append(time.monotonic() - started)
        best[n] = min(times)
    return (best[1600] - best[400]) / 1200


def grew(after, before, name: str, **labels) -> float:
    """How much a counter (summed over its series with ``labels``) grew between two scrapes."""
    return sum_samples(after, name, **labels) - sum_samples(before, name, **labels)


class CostWatch:
    """Within ``with``: every positive cost per token ``srv`` publishes on /metrics (``costs``),
    read every 50 ms on a thread of its own."""

    def __init__(self, srv: VllmServer) -> None:
        self.srv, self.costs = srv, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _read(self) -> None:
        if (cost := sample(self.srv.samples(), PER_TOKEN) or 0.0) > 0:
            self.costs.append(cost)

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            self._read()

    def __enter__(self) -> CostWatch:
        self._read()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def test_every_request_of_a_warm_restart_hits_and_the_prefill_cost_is_still_measured(restarted):
    """Runs after the checks above: counts are taken over its own requests."""
    srv = restarted["server"]
    before = srv.samples()
    started = time.monotonic()
    loaded = 0
    # The engine prices each hit at the cost per token it has measured by then; the cost moves
    # with the machine's load (a fit over its steps), also within one request, so the final
    # estimate alone does not price every hit. Every estimate it publishes (its gauges, sampled
    # at most every 0.1 s while requests run) is watched: the hits were priced within them.
    seen = CostWatch(srv)
    priced = 0  # tokens of hits asked for once a cost was known
    with seen:
        for i, prefix in enumerate(PREFIXES):  # each hits its prefix and computes a new tail
            known = bool(seen.costs)
            tail = prompt_tokens(100 + (113 * i) % 1300, 900 + i)
            out = srv.complete(prefix + tail, max_tokens=4)["kv_transfer_params"]["kvlens"]
            assert out["loaded_tokens"] == {"disk": len(prefix)}
            loaded += len(prefix)
            priced += len(prefix) if known else 0
    wall = time.monotonic() - started

    def measured():  # a cost, not the 0 a series existing from start-up would show
        s = srv.samples()
        return s if (sample(s, PER_TOKEN) or 0) > 0 else None

    s = wait_until(measured, what="a prefill cost measured from steps that all loaded")
    estimate = sample(s, PER_TOKEN)
    saved = grew(s, before, "vllm:kvlens_prefill_seconds_saved_total", tier="disk")
    costs = seen.costs or [estimate]
    assert priced > 0, "no hit came after the cost was known"
    # The watcher samples the published cost every 0.05 s; between two samples the engine may
    # price a hit at an estimate it published for less than that (a CI run: 1.52x the highest
    # sample, under the 1.5x this allowed before). 3x still catches a slip of unit or granularity.
    low, high = priced * min(costs) / 3, loaded * max(costs) * 3
    assert low <= saved <= high, (low, saved, high)  # every hit priced once the cost was known
    # Against the wall clock: new prompts' latency grows by about the estimate per token, within
    # an order of magnitude (a slip of unit or of granularity, per chunk or per request, is 256x
    # to 1000x off). Not within 3x: the engine fits its steps as the machine's load comes, the
    # wall clock keeps the best of three, and on a slow CPU busy with another engine the two
    # were 5.3x apart (0.66 against 0.12 ms per token).
    measured_cost = cold_seconds_per_token(srv)
    assert measured_cost / 10 < estimate < measured_cost * 10, (estimate, measured_cost)

    # the bytes read from disk and copied into vLLM: vLLM's own disk-cached tokens, in records
    per_token = whole_chunk_bytes(restarted["disk"]) / CHUNK
    disk_tokens = grew(s, before, "vllm:prompt_tokens_cached_by_source_total", source="disk")
    assert disk_tokens == loaded
    for stage in ("read", "copy"):
        assert (
            grew(s, before, "vllm:kvlens_transfer_bytes_total", stage=stage, tier="disk")
            == loaded * per_token
        )
        assert 0 < grew(s, before, "vllm:kvlens_transfer_seconds_total", stage=stage, tier="disk") < wall

    # The read speed it reports is no faster than reading the same files plainly (seconds it
    # did not count would show here); its reads took less than the requests (above). No lower
    # bound from the plain reads: those run alone with a warm page cache, while the engine's
    # reads wait for the GIL and a core beside the model's steps. On a slow CPU busy with
    # another engine they measured 39 MB/s against plain reads of 6.6 GB/s.
    read_speed = (
        loaded * per_token / grew(s, before, "vllm:kvlens_transfer_seconds_total", stage="read", tier="disk")
    )
    plain = plain_read_speed(restarted["disk"])
    assert read_speed < 2 * plain, (read_speed, plain)
    print(f"prefill s/token: estimate {estimate:.3g}, wall clock {measured_cost:.3g}")
    print(f"disk read: {read_speed / 1e6:.0f} MB/s; plain reads of the files {plain / 1e6:.0f} MB/s")


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pgid: int) -> float:
    """User + system CPU time of every live process in the process group."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # field 5 of stat: the process group
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLOCK_TICKS


def test_an_idle_engine_uses_no_cpu_after_a_burst_of_writes(restarted):
    """KVLens keeps vLLM stepping while background writes are queued, so that their outcome
    reaches the scheduler; once the last one lands the engine must go idle at once, not spin
    empty steps until a drain limit. Measured as the CPU time of the whole `vllm serve` process
    group (API server, engine core, worker). Runs last: the restarted engine serves nothing else."""
    srv = restarted["server"]
    for i in range(8):  # a burst of new prompts whose chunks go to the CPU and disk tiers
        srv.complete(prompt_tokens(1200, 100 + i), max_tokens=2)
    wait_until(lambda: sample(srv.samples(), "vllm:kvlens_pending_writes") == 0, what="writes landed")
    time.sleep(3.0)
    before, started = cpu_seconds(srv.proc.pid), time.monotonic()
    time.sleep(8.0)
    cores = (cpu_seconds(srv.proc.pid) - before) / (time.monotonic() - started)
    # vLLM alone idles at about 0.02 cores here; a spinning engine used 1.7
    assert cores < 0.15, f"an idle engine used {cores:.2f} cores"
