"""Traffic for the live dashboard tests: prompts as token ids, vLLM's prefix cache flushed
between a prompt's first and second request (so that hits come from KVLens), a disk chunk
corrupted between store and load (a failed load that vLLM recomputes), and new prompts only
(misses). Loops are bounded in time."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from connector.tiers.disk import chunk_files as disk_chunk_files
from tests.telemetry.serve import VllmServer, prompt_tokens

PROMPT_TOKENS = 600  # two whole 256-token chunks and a partial one


def chunk_files(directory: str) -> set[str]:
    """Chunk files, as paths relative to ``directory``."""
    return {os.path.relpath(p, directory) for p in disk_chunk_files(directory)}


def settled_chunk_files(directory: str, quiet_s: float = 1.0, timeout: float = 30.0) -> set[str]:
    """The chunk files once background disk writes have stopped landing."""
    files, since, deadline = chunk_files(directory), time.monotonic(), time.monotonic() + timeout
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.1)
        now = chunk_files(directory)
        if now != files:
            files, since = now, time.monotonic()
    return files


def corrupt(path: Path) -> None:
    """Flip the last 8 bytes: the record's checksum no longer matches."""
    with open(path, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        tail = f.read(8)
        f.seek(-8, os.SEEK_END)
        f.write(bytes(b ^ 0xFF for b in tail))


class Traffic:
    """Distinct prompts from a seed counter, so that each test phase uses fresh ones."""

    def __init__(self, server: VllmServer, seed: int = 1000) -> None:
        self.server = server
        self.seed = seed
        self.requests = 0

    def prompt(self) -> list[int]:
        self.seed += 1
        return prompt_tokens(PROMPT_TOKENS, self.seed)

    def complete(self, prompt: list[int], **extra) -> dict:
        self.requests += 1
        return self.server.complete(prompt, **extra)

    def hit_cycle(self, older: list[list[int]]) -> list[int]:
        """A new prompt stored, vLLM's cache flushed, the prompt again (a KVLens hit, CPU tier)
        and a prompt from three cycles back (evicted from the small CPU tier: a disk hit)."""
        p = self.prompt()
        self.complete(p)
        self.server.reset_prefix_cache()
        self.complete(p)
        if len(older) >= 3:
            self.complete(older[-3])
        older.append(p)
        return p

    def hits(self, seconds: float) -> None:
        older: list[list[int]] = []
        p = self.hit_cycle(older)
        self.complete(p)  # served by vLLM's own prefix cache
        self.complete(self.prompt(), kv_transfer_params={"lmcache.skip_save": True})
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.hit_cycle(older)

    def failed_load(self, disk: str) -> dict:
        """A prompt whose two chunks are only on disk, corrupted there: its load fails."""
        before = settled_chunk_files(disk)
        p = self.prompt()
        cold = self.complete(p)
        deadline = time.monotonic() + 30
        while len(chunk_files(disk) - before) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        written = chunk_files(disk) - before
        assert len(written) == 2, written
        for _ in range(2):  # push it out of the CPU tier (it holds two prompts)
            self.complete(self.prompt())
        settled_chunk_files(disk)
        for name in written:
            corrupt(Path(disk, name))
        self.server.reset_prefix_cache()
        failed = self.complete(p)
        assert failed["choices"][0]["text"] == cold["choices"][0]["text"]
        assert failed["kv_transfer_params"]["kvlens"]["failed_blocks"] == 4, failed["kv_transfer_params"]
        return failed

    def misses_until(self, done, timeout: float) -> None:
        """New prompts only until ``done()`` is true or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for _ in range(3):
                self.complete(self.prompt())
            if done():
                return
        raise TimeoutError(f"condition not met after {timeout}s of misses")


class Background:
    """Hit cycles in a thread until stopped (traffic while a browser watches)."""

    def __init__(self, traffic: Traffic, pause_s: float = 0.2) -> None:
        self._traffic, self._pause = traffic, pause_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        older: list[list[int]] = []
        try:
            while not self._stop.is_set():
                self._traffic.hit_cycle(older)
                self._traffic.complete(self._traffic.prompt())
                self._stop.wait(self._pause)
        except BaseException as e:  # noqa: BLE001 - reported by stop()
            self.error = e

    def __enter__(self) -> Background:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
