"""Servers left running for the next benchmark run (``--server-pool FILE``).

A served benchmark given a pool file takes from it a server another run left there when that
server was started the same way (the same command and environment, apart from its port and a
context at least as long as this run needs) and is still healthy; it starts the others as
usual and leaves every server it used running in the pool. Whoever made the file stops them:
``python -m bench.lib.server_pool stop FILE``.

It is for runs that only need servers of the right shape, one after another (the smoke tests
of the benchmark scripts): a reused server keeps what its connector stored for earlier runs,
and its counters count them, so its figures are not comparable with a fresh server's.

The file is JSON, one entry per server (signature, URL, process group, context length, log),
rewritten under an exclusive lock.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .servers import group_alive, signal_group

# Options whose value differs between servers that are otherwise the same; the context length
# is compared on its own (a longer one serves a shorter need).
_VOLATILE = ("--port",)
_CONTEXT = "--max-model-len"
# Variables that say where the starting run came from (pytest's current test, the shell's last
# command), not how the server runs.
_BOOKKEEPING_ENV = ("PYTEST_", "_", "OLDPWD", "PWD")


@dataclass(frozen=True, slots=True)
class PooledServer:
    signature: str
    url: str
    pgid: int  # the server's process group (it leads its own session)
    max_model_len: int
    log: str
    in_use: bool = True  # by a run now; False: waiting for the next run


def signature(cmd: Sequence[str], env: Mapping[str, str]) -> tuple[str, int]:
    """(what must match for a server to be reused, its context length): ``cmd`` without its port
    and context length, and the environment it was given (without bookkeeping variables)."""
    kept, max_len, skip = [], 0, False
    for i, arg in enumerate(cmd):
        if skip:
            skip = False
            continue
        if arg in _VOLATILE or arg == _CONTEXT:
            skip = True
            if arg == _CONTEXT:
                max_len = int(cmd[i + 1])
            continue
        kept.append(arg)
    env_kept = sorted((k, v) for k, v in env.items() if not k.startswith(_BOOKKEEPING_ENV))
    blob = json.dumps({"cmd": kept, "env": env_kept})
    return hashlib.sha256(blob.encode()).hexdigest()[:24], max_len


class ServerPool:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    @contextlib.contextmanager
    def _entries(self) -> Iterator[list[PooledServer]]:
        """The entries, under the file's lock; what the caller leaves in the list is written back."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(self.path.suffix + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                raw = json.loads(self.path.read_text()) if self.path.exists() else []
                entries = [PooledServer(**e) for e in raw]
            except (ValueError, TypeError) as e:
                raise SystemExit(f"--server-pool {self.path}: not a server pool file ({e})") from None
            yield entries
            tmp = self.path.with_suffix(self.path.suffix + ".tmp")
            tmp.write_text(json.dumps([asdict(e) for e in entries], indent=1))
            os.replace(tmp, self.path)

    def waiting(self) -> list[PooledServer]:
        """The live servers no run is using."""
        with self._entries() as entries:
            return [e for e in entries if not e.in_use and group_alive(e.pgid)]

    def take(self, sig: str, max_model_len: int, healthy: Callable[[str], bool]) -> PooledServer | None:
        """A live, healthy server no run is using, with signature ``sig`` and a context of at
        least ``max_model_len``, now in use (``give_back`` frees it); dead ones are dropped."""
        with self._entries() as entries:
            entries[:] = [e for e in entries if group_alive(e.pgid)]
            for i, e in enumerate(entries):
                fits = e.signature == sig and e.max_model_len >= max_model_len
                if fits and not e.in_use and healthy(e.url):
                    entries[i] = replace(e, in_use=True)
                    return entries[i]
        return None

    def add(self, server: PooledServer) -> None:
        """A server this run started: in the pool from now on, so that its owner stops it even
        if the run never gives it back."""
        self._set(server, in_use=True)

    def give_back(self, server: PooledServer) -> None:
        """``server`` stays running for the next run."""
        self._set(server, in_use=False)

    def drop(self, server: PooledServer) -> None:
        """``server`` is stopped (or broken): out of the pool."""
        with self._entries() as entries:
            entries[:] = [e for e in entries if e.pgid != server.pgid]

    def _set(self, server: PooledServer, in_use: bool) -> None:
        with self._entries() as entries:
            entries[:] = [e for e in entries if e.pgid != server.pgid]
            entries.append(replace(server, in_use=in_use))

    def stop_all(self, grace_s: float = 30.0) -> int:
        """Stops every server in the pool (SIGTERM, then SIGKILL to its group); returns how many."""
        with self._entries() as entries:
            pgids, entries[:] = [e.pgid for e in entries], []
        for pgid in pgids:
            signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(group_alive(p) for p in pgids) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pgid in pgids:
            signal_group(pgid, signal.SIGKILL)
        return len(pgids)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.lib.server_pool", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    stop = sub.add_parser("stop", help="stop every server in the pool file")
    stop.add_argument("file", type=Path)
    args = parser.parse_args(argv)
    print(f"stopped {ServerPool(args.file).stop_all()} server(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
