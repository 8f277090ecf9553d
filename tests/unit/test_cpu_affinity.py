"""KVLens's threads in a vLLM worker run beside the worker's bound cores, not on them."""

import os
import threading

import pytest

from connector.cpu_affinity import node_cpus, parse_cpulist
from connector.engine.health import TierHealth
from connector.tiers.background import BackgroundTier
from connector.tiers.cpu import CpuTier

needs_two_cpus = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and at least two CPUs this process may use",
)


def test_parse_cpulist():
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("5") == {5}
    with pytest.raises(ValueError):
        parse_cpulist("3-1")


def test_node_cpus_widens_to_the_nodes_holding_the_bound_cpus(tmp_path):
    for node, cpus in (("node0", "0-3"), ("node1", "4-7")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus + "\n")
    (tmp_path / "possible").write_text("0-7\n")  # not a node
    assert node_cpus({5}, str(tmp_path)) == {4, 5, 6, 7}
    assert node_cpus({3, 4}, str(tmp_path)) == set(range(8))
    assert node_cpus({1}, str(tmp_path / "missing")) >= {1}  # unknown nodes: every CPU


def _affinity_of_threads_started_while_bound(start):
    """Start threads (``start()`` returns them) from a thread bound to one CPU; their affinities."""
    out = {}

    def bound_starter():
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        out["threads"] = start()

    t = threading.Thread(target=bound_starter)
    t.start()
    t.join()
    for _ in range(100):  # the threads widen their own binding as their first step
        affinities = [os.sched_getaffinity(th.native_id) for th in out["threads"]]
        if all(len(a) > 1 for a in affinities):
            break
        threading.Event().wait(0.01)
    return affinities


@needs_two_cpus
def test_background_tier_threads_leave_the_core_of_the_thread_that_made_them():
    tiers = []

    def start():
        tier = BackgroundTier(CpuTier(), TierHealth("disk"))
        tiers.append(tier)
        return [tier._writer, *tier._readers]

    affinities = _affinity_of_threads_started_while_bound(start)
    tiers[0].close()
    assert all(len(a) > 1 for a in affinities), affinities


@needs_two_cpus
def test_the_copy_thread_leaves_the_core_of_the_thread_that_made_it():
    from connector.worker.layer_copies import CopyThread

    threads = []

    def start():
        threads.append(CopyThread())
        return [threads[0]._thread]

    affinities = _affinity_of_threads_started_while_bound(start)
    threads[0].close()
    assert all(len(a) > 1 for a in affinities), affinities


linux_nice = pytest.mark.skipif(not hasattr(os, "getpriority"), reason="needs per-thread nice values")


def _nice(native_id: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, native_id)


@linux_nice
def test_slow_tier_readers_and_outside_step_loads_yield_to_the_forward_pass_and_copies_and_writes_do_not():
    from connector.worker.async_loads import AsyncLoader
    from connector.worker.layer_copies import CopyThread

    own = _nice(threading.get_native_id())
    tier = BackgroundTier(CpuTier(), TierHealth("disk"))
    loader = AsyncLoader(lambda job, effects, cancelled: None)
    copies = CopyThread()
    try:
        reader_nice = tier.run(lambda: _nice(threading.get_native_id())).result(timeout=5)
        assert reader_nice > own
        for _ in range(100):  # the threads lower their own priority as their first step
            if _nice(loader._thread.native_id) > own:
                break
            threading.Event().wait(0.01)
        assert _nice(loader._thread.native_id) > own
        assert _nice(copies._thread.native_id) == own  # the forward pass waits for its copies
        assert _nice(tier._writer.native_id) == own  # the next request looks up what it wrote
        assert _nice(threading.get_native_id()) == own  # only their own threads changed
    finally:
        tier.close()
        loader.close()
        copies.close()
