"""scripts/slow_cpu.py, the slower-CPU simulation: a real-time burner per core takes its share
of every core while the command runs, the command's exit status passes through, nothing is
left running, and a bad share is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "slow_cpu.py"

# Run as the slowed command: after 1.5 s, its sibling burners' pids, scheduling policies and CPU
# seconds (a run of the suite under slow_cpu.py has burners of its own, a level up).
INSPECT = """
import json, os, time
time.sleep(1.5)
found = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
        stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        continue
    mine = int(stat[1]) == os.getppid()
    if mine and any(part.endswith(b"slow_cpu.py") for part in cmd) and b"--burn" in cmd:
        ticks = int(stat[11]) + int(stat[12])
        found.append({"pid": int(pid), "policy": int(stat[38]), "cpu_s": ticks / os.sysconf("SC_CLK_TCK")})
print(json.dumps(found))
"""


def slowed(*command: str, share: str = "0.3") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--share", share, "--", *command],
        capture_output=True,
        text=True,
        timeout=60,
    )


def burners() -> set[str]:
    """The pids of every running burner on the machine (an exited one its new parent has not
    reaped yet is a zombie, not a burner)."""
    found = subprocess.run(["pgrep", "-f", "slow_cpu.py --burn"], capture_output=True, text=True)
    return {pid for pid in found.stdout.split() if _state(pid) not in ("Z", "X", None)}


def _state(pid: str) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


@pytest.fixture
def realtime_allowed():
    probe = slowed(sys.executable, "-c", "pass")
    if "could not start" in probe.stderr:
        pytest.skip("SCHED_FIFO is not allowed here (needs root or CAP_SYS_NICE)")
    assert probe.returncode == 0, probe.stderr


def test_every_core_has_a_realtime_burner_taking_its_share(realtime_allowed):
    done = slowed(sys.executable, "-c", INSPECT)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert len(found) == len(os.sched_getaffinity(0))
    for b in found:
        assert b["policy"] == 1  # SCHED_FIFO: it takes its share whatever else runs
        # 0.3 of ~1.7 s (start-up included); real time preempts every other thread
        assert 0.25 < b["cpu_s"] < 0.9, found
    assert not {str(b["pid"]) for b in found} & burners()  # stopped with the command


def test_the_commands_exit_status_passes_through_and_no_burner_is_left(realtime_allowed):
    before = burners()
    assert slowed(sys.executable, "-c", "raise SystemExit(3)").returncode == 3
    assert burners() <= before


def test_a_share_out_of_range_is_refused():
    before = burners()
    done = slowed("true", share="1.5")
    assert done.returncode == 2 and "--share must be in (0, 0.9)" in done.stderr
    assert burners() <= before


def test_burners_stop_when_the_script_is_killed(realtime_allowed):
    """SIGKILL leaves the script no chance to stop them: they notice on their own."""
    import signal
    import time

    script = subprocess.Popen([sys.executable, str(SCRIPT), "--share", "0.3", "--", "sleep", "30"])
    children: set[str] = set()
    try:
        deadline = time.monotonic() + 10
        mine: set[str] = set()
        while len(mine) < len(os.sched_getaffinity(0)) and time.monotonic() < deadline:
            time.sleep(0.1)
            found = subprocess.run(["pgrep", "-P", str(script.pid)], capture_output=True, text=True)
            children = set(found.stdout.split())
            mine = children & burners()
        assert len(mine) == len(os.sched_getaffinity(0)), mine
        os.kill(script.pid, signal.SIGKILL)
        script.wait()
        deadline = time.monotonic() + 10
        while mine & burners() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not mine & burners(), "a burner outlived the script"
    finally:
        if script.poll() is None:
            script.kill()
        for pid in children:  # the orphaned `sleep 30` (and any burner the assertion caught)
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
