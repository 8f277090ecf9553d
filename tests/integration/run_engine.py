"""Runs one offline vLLM engine through a scripted workload and prints JSON results.

Used by the integration tests as a subprocess so that every engine gets a clean process.
The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the connector
halves can be inspected after the workload: trackers, pins, failed blocks.

    python run_engine.py SPEC.json   ->   last stdout line: {"rounds": [...], "state": {...}}
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time


def damage(
    directory: str,
    corrupt: int,
    delete: int,
    rank: int | None = None,
    smallest: bool = False,
    middle: int = 0,
) -> list[str]:
    """Corrupt then delete chunk files (of one rank, smallest first when asked). ``middle``:
    each corrupted file has that many random bytes written over its middle instead of its
    last 8 bytes flipped (at most half the file, centred on its middle; sizes kept)."""
    import random

    from connector.tiers.disk import chunk_files

    suffix = ".kvlens" if rank is None else f".r{rank}.kvlens"
    files = [os.path.relpath(p, directory) for p in chunk_files(directory) if p.endswith(suffix)]
    if smallest:
        files.sort(key=lambda f: os.path.getsize(os.path.join(directory, f)))
    touched = []
    for name in files[:corrupt]:
        path = os.path.join(directory, name)
        with open(path, "r+b") as f:
            if middle:
                size = os.path.getsize(path)
                n = min(middle, size // 2)
                f.seek(size // 2 - n // 2)
                f.write(random.Random(name).randbytes(n))
                touched.append(name)
                continue
            f.seek(-8, os.SEEK_END)
            tail = f.read(8)
            f.seek(-8, os.SEEK_END)
            f.write(bytes(b ^ 0xFF for b in tail))
        touched.append(name)
    for name in files[corrupt : corrupt + delete]:
        os.unlink(os.path.join(directory, name))
        touched.append(name)
    return touched


def count_layer_hooks(worker) -> dict[str, int]:
    """Counts vLLM's per-layer connector calls that reach the worker (layer-wise copies)."""
    calls = {"wait_layer": 0, "save_layer": 0, "wait_layer_with_loads": 0}
    wait_layer, save_layer = worker.wait_layer, worker.save_layer

    def counting_wait(name):
        calls["wait_layer"] += 1
        calls["wait_layer_with_loads"] += bool(worker.step_copies is not None and worker.step_copies.loads)
        return wait_layer(name)

    def counting_save(plan, name):
        calls["save_layer"] += 1
        return save_layer(plan, name)

    worker.wait_layer, worker.save_layer = counting_wait, counting_save
    return calls


def rss_megabytes() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def force_async_scheduling() -> None:
    """vLLM's CPU platform turns asynchronous scheduling off; keep it on, as on a GPU, so the
    scheduler plans step N+1 before step N's output (and KVLens's report in it) arrives."""
    from vllm.platforms import cpu

    check = cpu.CpuPlatform.check_and_update_config.__func__

    def keep_async(cls, vllm_config):
        check(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    cpu.CpuPlatform.check_and_update_config = classmethod(keep_async)


def abort_once_loaded(llm, connector, prompts: list[list[int]], abort: int, params) -> list:
    """Sends ``prompts`` at once and steps the engine; request ``abort`` is aborted, as a client
    that disconnects is, once some rank has reported its asynchronous load and another has
    not (the scheduler holds that rank's outcome, waiting for the others). Outputs in order;
    None for the aborted one."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    ids = [f"abort-round-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
    partial = connector._scheduler.feedback._partial  # asynchronous loads some ranks reported
    deadline = time.monotonic() + 120
    aborted = False
    outs = {}
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise TimeoutError("the abort round never finished")
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        if not aborted and any(rid.startswith(ids[abort]) for rid in partial):
            engine.abort_request([ids[abort]])
            aborted = True
    if not aborted:
        raise AssertionError("no rank reported the load before the others")
    return [outs.get(rid) if i != abort else None for i, rid in enumerate(ids)]


def settle(llm, spec: dict, flush_writes) -> None:
    """Engines sharing a disk directory: once every engine has finished its rounds, step (a
    3-token prompt stores nothing) until the directory has not changed for ``quiet_s`` (longer
    than a merge waits for a change of its own to settle, 10 s), so that every engine's last
    scans, evictions and reports have landed in what it reports."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from connector.tiers.disk import chunk_files

    flush_writes()
    open(spec["mine"], "w").close()
    deadline = time.monotonic() + spec.get("timeout_s", 300)
    while not all(os.path.exists(p) for p in spec["others"]):
        if time.monotonic() > deadline:
            raise TimeoutError("the other engines never finished their rounds")
        time.sleep(0.2)
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False, ignore_eos=True)
    seen, quiet_since = None, time.monotonic()
    while time.monotonic() - quiet_since < spec.get("quiet_s", 13.0) and time.monotonic() < deadline:
        time.sleep(spec.get("sleep_s", 2.0))
        llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], params, use_tqdm=False)
        flush_writes()
        now = set(chunk_files(spec["dir"]))
        if now != seen:
            seen, quiet_since = now, time.monotonic()


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    if spec.get("async_scheduling"):
        force_async_scheduling()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs = dict(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=4096,
        dtype="float32",  # greedy outputs of a random tiny model are compared bit for bit
        seed=0,
    )
    kwargs.update(spec.get("engine", {}))
    if spec.get("kv") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVLensConnector",
            kv_connector_module_path="connector",
            kv_role=spec.get("role", "kv_both"),
            kv_load_failure_policy=spec.get("policy", "recompute"),
            kv_connector_extra_config=spec["kv"],
        )
    llm = LLM(**kwargs)
    core = llm.llm_engine.engine_core.engine_core
    if spec.get("async_scheduling"):
        assert core.batch_queue is not None, "asynchronous scheduling did not take effect"
    connector = core.scheduler.connector
    failed_blocks: list[int] = []
    failed_by_round: list[list[int]] = []
    worker = None  # the worker half, when the worker runs in this process (no tensor parallelism)
    if connector is not None:
        original = connector.update_connector_output

        def recording(output):  # what vLLM received as failed blocks, merged over ranks
            ids = sorted(output.invalid_block_ids or ())
            failed_blocks.extend(ids)
            if failed_by_round:
                failed_by_round[-1].extend(ids)
            return original(output)

        connector.update_connector_output = recording
        if kwargs.get("tensor_parallel_size", 1) == 1:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            worker = get_kv_transfer_group()._worker
            worker.layer_hook_calls = count_layer_hooks(worker)

    preemptions = [0]
    original_preempt = core.scheduler._preempt_request

    def counting_preempt(*args, **kw):
        preemptions[0] += 1
        return original_preempt(*args, **kw)

    core.scheduler._preempt_request = counting_preempt

    rounds = []

    def wait_for_probe(worker, tier: str, limit_s: float = 120.0) -> None:
        """Failed probes double a skipped tier's backoff, and how many fail depends on how fast
        the rounds before ran: a fixed sleep is not enough on a slow machine."""
        health = worker.health[tier]
        deadline = time.monotonic() + limit_s
        while (wait := health.next_probe_in_s()) > 0 and time.monotonic() < deadline:
            time.sleep(min(wait, 1.0) + 0.05)

    def flush_writes() -> None:  # background disk writes land before the harness looks
        if worker is not None:
            worker.flush()
        elif connector is not None:
            time.sleep(2.0)  # workers in other processes: give their writers time

    rss_mb: list[float] = []
    for rnd in spec["rounds"]:
        failed_by_round.append([])
        if rnd.get("damage"):
            flush_writes()
            d = rnd["damage"]
            damage(
                d["dir"],
                d.get("corrupt", 0),
                d.get("delete", 0),
                d.get("rank"),
                d.get("smallest", False),
                d.get("middle", 0),
            )
        if rnd.get("break_disk"):  # the disk tier's directory becomes a file: every I/O fails
            flush_writes()
            shutil.rmtree(rnd["break_disk"])
            with open(rnd["break_disk"], "w") as f:
                f.write("not a directory")
        if rnd.get("restore_disk"):
            os.unlink(rnd["restore_disk"])
            os.makedirs(rnd["restore_disk"])
        time.sleep(rnd.get("sleep_s", 0))
        if rnd.get("wait_for_probe"):  # until the tier's next probe is due, however far the backoff
            wait_for_probe(worker, rnd["wait_for_probe"])
        params = SamplingParams(
            temperature=0.0,
            max_tokens=rnd.get("max_tokens", 8),
            detokenize=False,
            ignore_eos=rnd.get("ignore_eos", True),  # a random model's end token means nothing
            logprobs=rnd.get("logprobs"),  # the top n of every generated position
        )
        if "abort_once_loaded" in rnd:
            outs = abort_once_loaded(llm, connector, rnd["prompts"], rnd["abort_once_loaded"], params)
        else:
            outs = llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in rnd["prompts"]], params, use_tqdm=False
            )
        rounds.append(
            [
                {
                    "token_ids": list(o.outputs[0].token_ids),
                    "num_cached_tokens": o.num_cached_tokens,
                    "kv_transfer_params": o.kv_transfer_params,
                    "finish_reason": o.outputs[0].finish_reason,
                    "top_logprobs": [
                        [[token, p.logprob] for token, p in position.items()]
                        for position in o.outputs[0].logprobs or []
                    ],
                }
                if o is not None
                else None
                for o in outs
            ]
        )
        if rnd.get("reset_prefix_cache", True):
            llm.reset_prefix_cache()
        rss_mb.append(rss_megabytes())
    if spec.get("settle"):
        settle(llm, spec["settle"], flush_writes)
    state = {
        "failed_blocks": failed_blocks,
        "failed_blocks_by_round": failed_by_round,
        "preemptions": preemptions[0],
        "rss_mb": rss_mb,
    }
    if connector is not None:
        sched = connector._scheduler
        sizes = sched.sizes()
        records = ("tiers", "retention")
        state.update(
            {f.name: getattr(sizes, f.name) for f in dataclasses.fields(sizes) if f.name not in records}
        )
        state["retention"] = {r.tier: dataclasses.asdict(r) for r in sizes.retention}
        state["tiers"] = {t.tier: {"chunks": t.chunks, "health": t.health.level} for t in sizes.tiers}
        state["pinned_chunks"] = sum(t.pinned_keys for t in sched.tiers.values())
        state["index_bytes"] = {name: t.used_bytes for name, t in sched.tiers.items()}
        cpu = worker.tiers.get("cpu") if worker is not None else None
        state["layer_hook_calls"] = getattr(worker, "layer_hook_calls", None)
        state["worker_cpu_bytes"] = cpu.used_bytes if cpu is not None else None
    port = os.environ.get("KVLENS_METRICS_PORT")
    if port:
        import urllib.request

        time.sleep(0.5)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            state["metrics"] = r.read().decode()
    flush_writes()
    print(json.dumps({"rounds": rounds, "state": state}))
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow teardown; nothing is left to flush


if __name__ == "__main__":
    main()
