"""A server whose worker runs in vLLM's engine core gets the threads vLLM's process split would
give its worker: the split binds one OpenMP thread per core of ``VLLM_CPU_OMP_THREADS_BIND``; in
the engine core nothing binds them, and torch ran one spinning thread per core of the machine
beside the other test worker's engines."""

from __future__ import annotations

import os

from bench.lib.servers import WORKER_IN_CORE_ARGS, cores_of, in_engine_core

CMD = ["python", "-m", "connector.launcher", "serve", "model"]


def test_a_bound_core_list_gives_one_thread_per_core_on_those_cores():
    cmd, env = in_engine_core(CMD, {"VLLM_CPU_OMP_THREADS_BIND": "1"})
    assert cmd == ["taskset", "-c", "1", *CMD, *WORKER_IN_CORE_ARGS]
    assert env["OMP_NUM_THREADS"] == "1" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    cmd, env = in_engine_core(CMD, {"VLLM_CPU_OMP_THREADS_BIND": "0-2,5"})
    assert cmd[:3] == ["taskset", "-c", "0-2,5"] and env["OMP_NUM_THREADS"] == "4"


def test_auto_gives_the_cores_left_after_the_reserved_ones_unbound():
    cores = len(os.sched_getaffinity(0))
    cmd, env = in_engine_core(CMD, {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})
    assert cmd == [*CMD, *WORKER_IN_CORE_ARGS]
    assert env["OMP_NUM_THREADS"] == str(max(1, cores - 1))


def test_bind_lists_that_are_not_one_ranks_cores_are_not_pinned():
    for bind in ("auto", "nobind", "0|1", "", "1-", "a"):
        assert cores_of(bind) is None, bind
    assert cores_of("3") == [3] and cores_of("0,2-3") == [0, 2, 3]


def test_the_benchs_server_with_its_worker_in_core_runs_it_so(tmp_path):
    from pathlib import Path

    from bench.lib.servers import VllmServer

    env = {"VLLM_CPU_OMP_THREADS_BIND": "1"}
    server = VllmServer("x", "python", Path("/m"), 1024, None, [], env, tmp_path / "log", worker_in_core=True)
    assert server.cmd[:3] == ["taskset", "-c", "1"] and server.cmd[-2:] == list(WORKER_IN_CORE_ARGS)
    assert server.env["OMP_NUM_THREADS"] == "1"
    plain = VllmServer("x", "python", Path("/m"), 1024, None, [], env, tmp_path / "log")
    assert plain.cmd[0] == "python" and "OMP_NUM_THREADS" not in plain.env
