"""bench/lib/server_pool.py: which server a run may reuse (started alike, long enough, healthy,
free), and that the pool's owner stops every server in it, also those no run gave back."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.lib.server_pool import PooledServer, ServerPool, signature  # noqa: E402
from bench.lib.servers import group_alive  # noqa: E402

CMD = ["python", "-m", "connector.launcher", "serve", "/m", "--port", "4100", "--max-model-len", "648"]
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTEST_CURRENT_TEST": "a.py::t (call)"}


def test_the_signature_ignores_the_port_the_context_and_pytests_bookkeeping():
    sig, max_len = signature(CMD, ENV)
    assert max_len == 648
    other_port = [*CMD[:6], "4200", *CMD[7:-1], "1564"]
    assert signature(other_port, {**ENV, "PYTEST_CURRENT_TEST": "b.py::u (call)"}) == (sig, 1564)
    assert signature([*CMD, "--dtype", "float32"], ENV)[0] != sig
    assert signature(CMD, {**ENV, "VLLM_CPU_KVCACHE_SPACE": "2"})[0] != sig


def detached_sleeper() -> int:
    """The process group of a ``sleep`` in a session of its own whose parent has exited (as a
    server left by a finished run is): once killed it is reaped at once, not left a zombie."""
    out = subprocess.run(
        ["setsid", "sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"],
        capture_output=True,
        text=True,
        timeout=10,
    )
    return os.getpgid(int(out.stdout))


def entry(pgid: int, max_len: int = 648, sig: str = "s", url: str = "http://127.0.0.1:1") -> PooledServer:
    return PooledServer(sig, url, pgid, max_len, "/log")


def test_a_free_healthy_server_started_alike_with_enough_context_is_taken_once(tmp_path):
    pool = ServerPool(tmp_path / "pool.json")
    me = os.getpgrp()  # a live process group
    pool.add(entry(me, max_len=656))
    healthy = lambda url: True  # noqa: E731
    assert pool.take("s", 648, healthy) is None  # its run has not given it back
    assert pool.waiting() == []
    pool.give_back(entry(me, max_len=656))
    assert [e.pgid for e in pool.waiting()] == [me]
    assert pool.take("other", 648, healthy) is None
    assert pool.take("s", 700, healthy) is None  # too short a context
    assert pool.take("s", 648, lambda url: False) is None  # not answering
    taken = pool.take("s", 648, healthy)
    assert taken is not None and taken.pgid == me and taken.in_use
    assert pool.waiting() == []
    assert pool.take("s", 648, healthy) is None  # in use by the run that took it


def test_dead_servers_leave_the_pool(tmp_path):
    pool = ServerPool(tmp_path / "pool.json")
    proc = subprocess.Popen(["true"], start_new_session=True)
    proc.wait()
    pool.give_back(entry(proc.pid))
    assert pool.take("s", 648, lambda url: True) is None
    assert "pgid" not in (tmp_path / "pool.json").read_text()


def test_the_owner_stops_every_server_also_one_never_given_back(tmp_path):
    pool = ServerPool(tmp_path / "pool.json")
    groups = [detached_sleeper() for _ in range(2)]
    pool.add(entry(groups[0]))  # its run died before giving it back
    pool.give_back(entry(groups[1], sig="t"))
    t0 = time.monotonic()
    assert pool.stop_all(grace_s=20) == 2
    assert time.monotonic() - t0 < 10  # stopped by SIGTERM, not left to the grace period
    assert not any(group_alive(g) for g in groups)
    assert pool.stop_all() == 0


def test_the_stop_command_stops_the_pool(tmp_path):
    path = tmp_path / "pool.json"
    group = detached_sleeper()
    ServerPool(path).give_back(entry(group))
    cmd = [sys.executable, "-m", "bench.lib.server_pool", "stop", str(path)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "stopped 1 server(s)" in done.stdout
    assert not group_alive(group)
