"""Files this process makes for its own lifetime only, removed when it ends, however it ends.

The admin endpoint's per-start token file and the PD decoder's shared-memory receive buffers
belong to the engine-core process. vLLM's API server stops that process with SIGTERM and, its
default shutdown timeout being 0, SIGKILLs it at once: no ``atexit``, no ``finally``, no
connector ``shutdown`` runs. So each such file is handed to a small watchdog process at
creation: it reads the owner's list over a pipe and, when the pipe closes (the owner exited,
crashed or was killed), removes every file that is still the one it was told of (same device and
inode, same content where the owner said what it wrote, and no lock held on it: a file made
since at the same path by another process stays). The watchdog leaves the owner's process tree
(it forks and its parent exits: vLLM kills every descendant of its engine core) and runs in a
session of its own, so neither a terminal's Ctrl-C nor a SIGKILL meant for the engine's tree or
group stops it before its work; it exits once it has cleaned up. The owner still removes its
files itself on an orderly shutdown; the watchdog then finds nothing to do.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

logger = logging.getLogger("vllm.kvlens")

# The watchdog: lines "path\tdevice\tinode\tsha256 or -" until end of input; then each file that
# is still the one it was told of goes: same device and inode (numbers a file made since may
# reuse), the same content where a digest was given, and locked by nobody (a live owner's
# buffer holds its lock).
_WATCHDOG = r"""
import fcntl, hashlib, os, signal, sys
if os.fork():  # leave the owner's process tree: vLLM SIGKILLs every descendant of its engine core
    os._exit(0)
os.setsid()
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
files = [line.rstrip("\n").rsplit("\t", 3) for line in sys.stdin]
for path, dev, ino, digest in files:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        continue
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (int(dev), int(ino)):
            continue
        if digest != "-" and hashlib.sha256(os.read(fd, 1 << 16)).hexdigest() != digest:
            continue
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.unlink(path)
    except OSError:
        pass
    finally:
        os.close(fd)
"""


class ExitCleanup:
    """Thread-safe; ``add`` starts the watchdog on first use and never raises. Closing the pipe
    (this process ending) is the watchdog's signal; nothing else stops it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watchdog: subprocess.Popen[bytes] | None = None

    def add(self, path: str | Path, content: bytes | None = None) -> bool:
        """Remove ``path`` (as it is now; only while it holds ``content``, when given) when this
        process ends; False when that cannot be arranged (logged: the file then outlives a killed
        engine, as before)."""
        try:
            st = os.lstat(path)
            digest = hashlib.sha256(content).hexdigest() if content is not None else "-"
            line = f"{path}\t{st.st_dev}\t{st.st_ino}\t{digest}\n".encode()
            with self._lock:
                for attempt in (1, 2):  # a watchdog gone (killed on its own) is started again
                    try:
                        if self._watchdog is None:
                            self._watchdog = _start()
                        assert self._watchdog.stdin is not None
                        self._watchdog.stdin.write(line)
                        self._watchdog.stdin.flush()
                        break
                    except BrokenPipeError:
                        self._watchdog = None
                        if attempt == 2:
                            raise
            return True
        except (OSError, ValueError, subprocess.SubprocessError) as e:
            logger.warning("KVLens: %s will not be removed if this engine is killed: %s", path, e)
            return False


def _start() -> subprocess.Popen[bytes]:
    """The watchdog, once it has left this process's tree (its first process exits at once)."""
    launcher = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _WATCHDOG],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )
    launcher.wait(10)  # the first process; the watchdog keeps the pipe's other end
    return launcher


_PROCESS = ExitCleanup()


def remove_at_exit(path: str | Path, content: bytes | None = None) -> bool:
    """This process's watchdog removes ``path`` when the process ends (see the module)."""
    return _PROCESS.add(path, content)
