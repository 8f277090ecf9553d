"""Run a command on a simulated slower CPU: every core loses the same share of its time.

    sudo python3 scripts/slow_cpu.py [--share 0.34] -- bash scripts/test.sh --durations=0
    sudo python3 scripts/slow_cpu.py --check        # the slowdown a CPU-bound loop sees

One burner process per core runs at real-time priority (SCHED_FIFO, so it needs root or
CAP_SYS_NICE) and keeps its core busy for ``share`` of every 10 ms, on the same 10 ms boundaries
on every core: each thread of the command runs that much slower, whatever the others do, and
threads that wait for each other (TP ranks, OpenMP teams) are slowed together, as on a slower
CPU. A CPU quota (cgroup ``cpu.cfs_quota_us``) is the other common simulation; it slows a
process only while the cores are busy together, so a serial phase (a pip install, one engine
starting) runs at full speed under it.

The default share, 0.34, measured a 1.43-1.47x slowdown of a busy loop here (``--check``): the
ratio of the suite's integration run on the slower machine of issue 29 (43:23 against 29:47).
Python only, no dependency: it runs before the virtualenv exists.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time

PERIOD_S = 0.010
PR_SET_PDEATHSIG = 1  # prctl: a signal for this process when its parent dies
DEFAULT_SHARE = 0.34


def burn(core: int, share: float, parent: int) -> None:
    """Busy for ``share`` of every period of CLOCK_MONOTONIC, on ``core``, real-time, until
    ``parent``, the script that started it, is gone (killed too, also before this process got
    this far: a burner is never left behind)."""
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the kernel's notice
    os.sched_setaffinity(0, {core})
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    busy = PERIOD_S * share
    while os.getppid() == parent:
        start = (int(time.monotonic() / PERIOD_S) + 1) * PERIOD_S
        time.sleep(max(0.0, start - time.monotonic()))
        while time.monotonic() < start + busy:
            pass


def start_burners(share: float) -> list[subprocess.Popen]:
    """A burner per core this process may use; SystemExit if one cannot run (no RT priority)."""
    cores = sorted(os.sched_getaffinity(0))
    me, parent = os.path.abspath(__file__), str(os.getpid())
    burners = [
        subprocess.Popen([sys.executable, me, "--burn", str(c), "--share", str(share), "--parent", parent])
        for c in cores
    ]
    time.sleep(0.2)
    if any(b.poll() is not None for b in burners):
        stop(burners)
        raise SystemExit("slow_cpu: a burner could not start (SCHED_FIFO needs root or CAP_SYS_NICE)")
    return burners


def stop(burners: list[subprocess.Popen]) -> None:
    for b in burners:
        if b.poll() is None:
            b.terminate()
    for b in burners:
        b.wait()


def busy_loop_s() -> float:
    """Seconds a fixed CPU-bound loop takes on core 0 (this process moves there)."""
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    started = time.perf_counter()
    x = 0
    for i in range(20_000_000):
        x += i
    return time.perf_counter() - started


def check(share: float) -> int:
    """The slowdown of a busy loop with the burners against without, three pairs side by side."""
    ratios = []
    for _ in range(3):
        alone = busy_loop_s()
        burners = start_burners(share)
        try:
            time.sleep(0.3)
            slowed = busy_loop_s()
        finally:
            stop(burners)
        ratios.append(slowed / alone)
        print(f"alone {alone:.2f} s, slowed {slowed:.2f} s: {slowed / alone:.2f}x", flush=True)
    print(f"share {share}: median slowdown {sorted(ratios)[1]:.2f}x")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--share", type=float, default=DEFAULT_SHARE, help="of every core (default %(default)s)")
    p.add_argument("--check", action="store_true", help="measure the slowdown of a busy loop and exit")
    p.add_argument("--burn", type=int, help=argparse.SUPPRESS)  # one burner, on this core
    p.add_argument("--parent", type=int, help=argparse.SUPPRESS)  # ... while this process lives
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run slowed")
    a = p.parse_args()
    if not 0 < a.share < 0.9:
        p.error("--share must be in (0, 0.9)")
    if a.burn is not None:
        burn(a.burn, a.share, a.parent)
        return 0
    if a.check:
        return check(a.share)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        p.error("give a command after --, or --check")
    burners = start_burners(a.share)
    try:
        return subprocess.call(command)
    finally:
        stop(burners)


if __name__ == "__main__":
    sys.exit(main())
