"""Files an engine makes for its own lifetime (the admin token, the PD receive buffers) are removed
when it ends, however it ends: vLLM SIGKILLs its engine core at once on a stop. A file made since
at the same path, by someone else, stays; and the engine's own clean-up still works."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

OWNER = textwrap.dedent(
    """
    import sys, time
    from connector.scheduler.exit_cleanup import remove_at_exit
    for path in sys.argv[1:]:
        open(path, "w").write("mine")
        assert remove_at_exit(path, b"mine" if path.endswith(".token") else None)
    print("ready", flush=True)
    time.sleep(600)
    """
)


def _owner(*paths: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-c", OWNER, *map(str, paths)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # as vLLM's engine core: killed with its group
    )
    assert child.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
    return child


def _gone(path: Path, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while path.exists():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def _kill_tree(pid: int) -> None:
    """What vLLM's API server does to its engine core (vllm.utils.system_utils.kill_process_tree):
    SIGKILL to every descendant, then to the process."""
    import psutil

    for child in psutil.Process(pid).children(recursive=True):
        os.kill(child.pid, signal.SIGKILL)
    os.kill(pid, signal.SIGKILL)


def test_an_owner_killed_with_its_process_tree_leaves_none_of_its_files(tmp_path):
    token, buffer = tmp_path / "admin-1234.token", tmp_path / "kvlens-pd-1-r0-0123456789ab"
    child = _owner(token, buffer)
    _kill_tree(child.pid)
    os.killpg(child.pid, signal.SIGKILL)  # and its group
    child.wait(10)
    assert _gone(token) and _gone(buffer)


def test_a_file_made_since_at_the_same_path_is_not_removed(tmp_path):
    token = tmp_path / "admin-1234.token"
    child = _owner(token)
    token.unlink()
    token.write_text("the next engine's")  # another inode at the same path
    child.kill()
    child.wait(10)
    time.sleep(0.5)  # the watchdog has had its chance
    assert token.read_text() == "the next engine's"


def test_files_the_owner_removed_itself_are_left_alone(tmp_path):
    token = tmp_path / "admin-1234.token"
    child = _owner(token)
    token.unlink()
    child.send_signal(signal.SIGTERM)
    child.wait(10)
    time.sleep(0.2)
    assert not token.exists()


def test_a_file_another_live_process_holds_locked_is_not_removed(tmp_path):
    import fcntl

    buffer = tmp_path / "kvlens-pd-1-r0-0123456789ab"
    child = _owner(buffer)
    held = os.open(buffer, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # as a live decoder holds its buffer
    try:
        child.kill()
        child.wait(10)
        time.sleep(0.5)
        assert buffer.exists()
    finally:
        os.close(held)
