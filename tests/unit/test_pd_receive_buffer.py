"""The receive buffer's file: its owner's lock says it is alive, so clean-up removes only files
nobody holds, of this user, and never stops a decoder (issue 36, item 7); a free never waits."""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from connector.pd import receive_buffer
from connector.pd.receive_buffer import ReceiveBuffer, attach, remove_stale_buffers

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534


@pytest.fixture(autouse=True)
def shm(monkeypatch) -> Iterator[Path]:  # type: ignore[no-untyped-def]
    """A buffer directory of the test's own, shared like /dev/shm (sticky, everyone writes): other
    runs' clean-ups on this machine neither see these files nor lose theirs to these tests."""
    folder = Path(tempfile.mkdtemp(prefix="kvlens-rxbuf-test-", dir=receive_buffer.buffer_dir()))
    folder.chmod(0o1777)
    monkeypatch.setattr(receive_buffer, "buffer_dir", lambda: folder)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def buffer_dir() -> Path:
    return receive_buffer.buffer_dir()


def in_child(shm: Path, code: str) -> list[str]:
    """A Python command line whose process uses the test's buffer directory."""
    setup = (
        "import pathlib, connector.pd.receive_buffer as rb\n"
        f"rb.buffer_dir = lambda: pathlib.Path({str(shm)!r})\n"
    )
    return [sys.executable, "-c", setup + code]


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@contextmanager
def planted(pid: int | str, content: bytes = b"x" * 4096) -> Iterator[Path]:
    """A file under a buffer's name (owner ``pid``), removed after the test if it is still there."""
    path = buffer_dir() / f"kvlens-pd-{pid}-r0-{secrets.token_hex(6)}"
    path.write_bytes(content)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


@contextmanager
def locked_by_another_process(path: Path) -> Iterator[None]:
    """A process that holds ``path`` as its owner would: an exclusive ``flock`` for its life."""
    code = (
        "import fcntl, os, sys\n"
        f"fd = os.open({str(path)!r}, os.O_RDWR)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('locked', flush=True)\n"
        "sys.stdin.read()\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"locked\n"
        yield
    finally:
        holder.kill()
        holder.wait()


def test_a_planted_name_with_a_huge_pid_stops_neither_clean_up_nor_a_new_buffer():
    with planted(10**30) as path:
        assert remove_stale_buffers() == 1
        assert not path.exists()  # nobody held it: stale, whatever its name says
        buffer = ReceiveBuffer(4096, 0)
        buffer.close()


def test_a_buffer_held_by_its_owner_stays_though_its_pid_is_not_seen_here():
    with planted(dead_pid()) as path, locked_by_another_process(path):  # another PID namespace
        remove_stale_buffers()
        assert path.exists()


def test_a_file_nobody_holds_is_removed_whatever_pid_it_names():
    with planted(dead_pid()) as dead, planted(os.getppid()) as alive_pid:
        assert remove_stale_buffers() == 2
        assert not dead.exists() and not alive_pid.exists()


def test_clean_ups_at_once_remove_each_stale_file_once_and_warn_of_nothing(shm, caplog):
    pid = dead_pid()
    for _ in range(300):
        (shm / f"kvlens-pd-{pid}-r0-{secrets.token_hex(6)}").write_bytes(b"x")
    counts: list[int] = []
    threads = [threading.Thread(target=lambda: counts.append(remove_stale_buffers())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(counts) == 300 and list(shm.iterdir()) == []
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_another_users_file_is_left_alone():
    with planted(dead_pid()) as path:
        try:
            os.chown(path, NOBODY, NOBODY)
        except OSError as e:
            pytest.skip(f"cannot give a file to another user here: {e}")
        remove_stale_buffers()
        assert path.exists()


def test_a_symlink_under_the_prefix_is_neither_followed_nor_removed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    link = buffer_dir() / f"kvlens-pd-{dead_pid()}-r0-{secrets.token_hex(6)}"
    link.symlink_to(victim)
    try:
        fd = os.open(victim, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)  # were the link followed, the lock would be the victim's
        try:
            remove_stale_buffers()
        finally:
            os.close(fd)
        assert link.is_symlink() and victim.read_bytes() == b"keep me"
    finally:
        link.unlink(missing_ok=True)


def test_a_planted_fifo_does_not_block_clean_up_and_stays():
    path = buffer_dir() / f"kvlens-pd-{dead_pid()}-r0-{secrets.token_hex(6)}"
    os.mkfifo(path)
    try:
        done = threading.Event()
        threading.Thread(target=lambda: (remove_stale_buffers(), done.set()), daemon=True).start()
        assert done.wait(5.0), "clean-up blocked opening a fifo"
        assert path.exists()
    finally:
        path.unlink(missing_ok=True)


def test_a_stale_file_of_root_does_not_stop_a_decoder_of_another_user(shm):
    if os.geteuid() != 0:
        pytest.skip("needs root to plant root's file and become another user")
    become_nobody = f"import os; os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})\n"
    with planted(dead_pid()) as path:
        os.chmod(path, 0o600)
        code = become_nobody + "print(rb.remove_stale_buffers())"
        out = subprocess.run(in_child(shm, code), cwd=REPO, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "0" and path.exists()


def test_a_live_owners_buffer_survives_clean_up_and_goes_once_it_is_closed():
    buffer = ReceiveBuffer(4096, 0)
    path = buffer_dir() / buffer.name
    try:
        remove_stale_buffers()
        assert path.exists()
    finally:
        buffer.close()
    assert not path.exists()


def test_a_new_buffer_is_held_from_its_first_moment_and_leaves_no_other_file(shm):
    buffer = ReceiveBuffer(4096, 0)
    try:
        assert [p.name for p in shm.iterdir()] == [buffer.name]  # its hidden first name is gone
        fd = os.open(shm / buffer.name, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    finally:
        buffer.close()
    assert list(shm.iterdir()) == []


def test_a_workers_attach_neither_keeps_a_dead_owners_buffer_nor_ends_a_live_one(shm):
    code = (
        "import sys\n"
        "b = rb.ReceiveBuffer(4096, 0)\n"
        "b.writable(b.allocate_all([5])[0])[:] = b'hello'\n"
        "print(b.name, flush=True)\n"
        "sys.stdin.read()\n"
    )
    owner = subprocess.Popen(in_child(shm, code), cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert owner.stdout is not None
        name = owner.stdout.readline().decode().strip()
        worker = attach(name)
        remove_stale_buffers()
        assert (buffer_dir() / name).exists()  # the owner lives; the worker's mapping changed nothing
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        assert remove_stale_buffers() == 1 and not (buffer_dir() / name).exists()
        assert bytes(worker.view(0, 5)) == b"hello"  # the worker's mapping outlives the file
        worker.close()
    finally:
        owner.kill()
        owner.wait()


def test_free_soon_never_waits_and_the_lock_holder_frees_the_slots_after():
    buffer = ReceiveBuffer(4096, 0)
    try:
        slots = buffer.allocate_all([1024, 1024])
        assert slots is not None
        entered, leave = threading.Event(), threading.Event()
        real = buffer._allocator.allocate_all

        def slow(lengths):  # type: ignore[no-untyped-def]
            entered.set()
            leave.wait(30)
            return real(lengths)

        buffer._allocator.allocate_all = slow  # type: ignore[method-assign]
        receiver = threading.Thread(target=buffer.allocate_all, args=([64],))
        receiver.start()
        assert entered.wait(5)
        done = threading.Event()
        threading.Thread(target=lambda: (buffer.free_soon(slots), done.set()), daemon=True).start()
        assert done.wait(2.0), "free_soon waited for the buffer's lock"
        assert buffer.used_bytes == 2048
        leave.set()
        receiver.join()
        assert buffer.used_bytes == 64
    finally:
        buffer.close()
