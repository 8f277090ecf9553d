"""The remote tier against a bare client on the same redis-server: loads and stores, side by side.

    .venv/bin/python bench/remote_tier_vs_bare.py [--quick] [--rounds N] [--out results.json]
                                                  [--url redis://host:port/0] [--references]
                                                  [--sizes 4,1]

Without --url a private redis-server is started on a free loopback port (no persistence) and
stopped at the end. Per chunk size (4 MiB and 1 MiB, in batches of 8), each round runs every
mode over the same keys, batch by batch: each batch is read by every load mode, then written by
every store mode, each group in a random order, so that the modes share the machine's load and
none always follows the same one. The modes:

- ``bare GET``: the reference reader (``BareClient``), the fastest we could write: one socket,
  the batch's GETs pipelined, each reply's header line and the value's first bytes read with one
  ``recv_into`` into the start of one buffer allocated once, the header parsed there by hand and
  the rest of the value read right behind it. No checks.
- ``tier get_many``: ``RedisTier.get_many`` (record header and xxh3 checksum checked), and what
  the worker does next: each payload viewed as a KV payload by ``BlockCopier.payload_view`` and
  checked by ``check_payload``. The views are dropped after the batch, as the worker drops them
  after the step.
- ``background get_many``: the same through ``BackgroundTier`` (reader thread, deadline), as the
  worker calls it: its readers run below the forward pass's priority (``cpu_affinity``).
- ``background get_many, readers not lowered``: the same with readers at the caller's priority
  (``lower_readers=False``): what the lowered priority costs on this machine.
- ``redis-py GET``: redis-py's own pipeline (hiredis if installed), values decoded and checksummed:
  what the tier did before it read values itself.
- ``bare SET``: the reference writer. One socket, the batch's SETs pipelined, each one
  ``sendmsg`` of its RESP head, a ready record (header and payload, a memoryview, uncopied) and
  the CRLF; the ``+OK`` replies read at the end. No checksum.
- ``tier put_many``: ``RedisTier.put_many`` (the header and checksum computed per chunk).
- ``background put``: ``BackgroundTier.put`` per chunk, then waiting until written, as the
  worker's stores go.

With ``--references`` the bare clients the reference was chosen over run beside it, each as a
load and a store mode ("bare GET, <name>", a ratio above 1 would mean a faster reference
exists): the previous reference (header lines through a 4 KiB ``recv``, a SET in three
``sendall`` calls, a blocking socket) and the same on a socket with a timeout, the reference on a
blocking socket, a blocking socket with ``MSG_WAITALL`` reads and one ``sendmsg`` per batch, and
hiredis's reader over a raw socket when hiredis is importable (redis-py uses it for ``redis-py
GET`` then too).

Throughput is payload bytes per second; a ratio is the tier's over the bare client's in the same
round, and the table shows the median over rounds. The goal (issue 28) is >= 0.8x for loads and
stores. The load average before and after is printed and kept in --out: the figures mean little
on a busy machine. --quick runs in seconds (CI keeps the script working).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis  # noqa: E402
import torch  # noqa: E402
from redis.utils import HIREDIS_AVAILABLE  # noqa: E402

from bench.lib.ports import free_port  # noqa: E402
from connector.engine.health import TierHealth  # noqa: E402
from connector.tiers import codec  # noqa: E402
from connector.tiers.background import BackgroundTier  # noqa: E402
from connector.tiers.redis_tier import RedisTier  # noqa: E402
from connector.tiers.remote_url import parse_remote_url  # noqa: E402
from connector.worker.kv_blocks import BlockCopier  # noqa: E402

MB = 1024 * 1024
LAYOUT = "bench-layout"
BATCH = 8
LAYERS = 8
BLOCK_BYTES = 32 * 1024  # [2, 16 tokens, 8 heads, 64] float16: one layer's block
UNLOWERED = "background get_many, readers not lowered"
LOADS = ("bare GET", "tier get_many", "background get_many", UNLOWERED, "redis-py GET")
STORES = ("bare SET", "tier put_many", "background put")


@contextmanager
def private_server() -> Iterator[str]:
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server is not installed (bash scripts/setup.sh), or pass --url")
    port = free_port()
    with tempfile.TemporaryDirectory() as workdir:
        cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        cmd += ["--dir", workdir, "--logfile", os.path.join(workdir, "redis.log")]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        try:
            client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1)
            for _ in range(250):
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.02)
            client.close()
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


_FIRST = 64 * 1024  # what a reply's first read asks for: its header line and the value's start
_HEAD = 64  # room for a bulk reply's header line ("$<length>\r\n")
OK = b"+OK\r\n"


def get_frames(keys: list[bytes]) -> bytes:
    return b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (len(k), k) for k in keys)


def set_head(key: bytes, size: int) -> bytes:
    return b"*3\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n" % (len(key), key, size)


def _connect(host: str, port: int, timeout_s: float | None = 30.0) -> socket.socket:
    """A socket with a timeout (as redis-py's and the tier's are): measured faster here than a
    blocking one for GETs (--references), as fast for SETs."""
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(timeout_s)
    return sock


def _sendmsg_all(sock: socket.socket, pieces: list) -> None:
    views = [memoryview(p).cast("B") for p in pieces]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= views[0].nbytes:
            sent -= views.pop(0).nbytes
        if sent:
            views[0] = views[0][sent:]


class BareClient:
    """The reference: the fastest bare RESP client we could write for this job in Python.

    One socket with a timeout, as redis-py's. GETs: the batch's commands in one send; each
    reply's first read lands at the start of one buffer allocated once (its header line and the
    value's first bytes), the header is parsed in place and the rest of the value is read with
    ``recv_into`` right behind it. SETs: each command is one ``sendmsg`` of its RESP head, the
    value (a memoryview, never copied) and the CRLF; the batch's ``+OK`` replies are read at the
    end into the same buffer. No checks. ``--references`` runs it beside the alternatives it
    was chosen over.
    """

    def __init__(self, host: str, port: int, max_value: int) -> None:
        self.sock = _connect(host, port)
        self.buffer = bytearray(_HEAD + max_value + 2 + _FIRST)
        self.view = memoryview(self.buffer)
        self.have = 0  # bytes of the next reply already at the buffer's start

    def get_many(self, keys: list[bytes]) -> int:
        self.sock.sendall(get_frames(keys))
        return sum(self._bulk() for _ in keys)

    def _bulk(self) -> int:
        buffer, view, recv_into = self.buffer, self.view, self.sock.recv_into
        have = self.have
        while (end := buffer.find(b"\r\n", 0, have)) < 0:
            have += _got(recv_into(view[have : have + _FIRST]))
        if buffer[0] != ord("$"):
            raise RuntimeError(f"unexpected reply {bytes(buffer[:end])!r}")
        size = int(buffer[1:end])
        stop = end + 2 + size + 2
        while have < stop:
            have += _got(recv_into(view[have:stop]))
        self.have = have - stop  # a first read that went past this reply: the next one's start
        if self.have:
            view[: self.have] = view[stop:have]
        return size

    def set_many(self, items: list[tuple[bytes, memoryview]]) -> None:
        for key, value in items:
            _sendmsg_all(self.sock, [set_head(key, value.nbytes), value, b"\r\n"])
        self._replies(OK * len(items))

    def _replies(self, expected: bytes) -> None:
        want = len(expected)
        have = self.have
        while have < want:
            have += _got(self.sock.recv_into(self.view[have:want]))
        if self.view[:want] != expected:
            raise RuntimeError(f"unexpected replies {bytes(self.view[:want])[:80]!r}")
        self.have = 0

    def close(self) -> None:
        self.sock.close()


def _got(n: int) -> int:
    if not n:
        raise ConnectionError("server closed the connection")
    return n


class PreviousReference:
    """The reference before: header lines through a small ``recv`` buffer, then copied; values
    with ``recv_into`` into one buffer; a SET in three ``sendall`` calls."""

    def __init__(self, host: str, port: int, max_value: int) -> None:
        self.sock = _connect(host, port)
        self.buffer = memoryview(bytearray(max_value + 2))
        self.pending = bytearray()

    def get_many(self, keys: list[bytes]) -> int:
        self.sock.sendall(get_frames(keys))
        total = 0
        for _ in keys:
            size = int(self._line()[1:])
            want = size + 2  # the value and its CRLF
            have = min(len(self.pending), want)
            self.buffer[:have] = self.pending[:have]
            del self.pending[:have]
            while have < want:
                have += _got(self.sock.recv_into(self.buffer[have:want]))
            total += size
        return total

    def set_many(self, items: list[tuple[bytes, memoryview]]) -> None:
        for key, value in items:
            self.sock.sendall(set_head(key, value.nbytes))
            self.sock.sendall(value)
            self.sock.sendall(b"\r\n")
        for _ in items:
            if self._line() != b"+OK":
                raise RuntimeError("SET failed")

    def _line(self) -> bytes:
        while (end := self.pending.find(b"\r\n")) < 0:
            self.pending += self.sock.recv(4096)
        line = bytes(self.pending[:end])
        del self.pending[: end + 2]
        return line

    def close(self) -> None:
        self.sock.close()


class BlockingClient(BareClient):
    """The reference on a blocking socket (no poll() before each call)."""

    def __init__(self, host: str, port: int, max_value: int) -> None:
        super().__init__(host, port, max_value)
        self.sock.settimeout(None)


class WaitAllClient(BlockingClient):
    """The reference on a blocking socket, each value's rest read in one ``recv_into(...,
    MSG_WAITALL)`` (a socket with a timeout cannot wait for all) and a batch's SETs in one
    ``sendmsg``."""

    def _bulk(self) -> int:
        buffer, view, recv_into = self.buffer, self.view, self.sock.recv_into
        have = self.have
        while (end := buffer.find(b"\r\n", 0, have)) < 0:
            have += _got(recv_into(view[have : have + _FIRST]))
        size = int(buffer[1:end])
        stop = end + 2 + size + 2
        while have < stop:
            have += _got(recv_into(view[have:stop], stop - have, socket.MSG_WAITALL))
        self.have = have - stop
        if self.have:
            view[: self.have] = view[stop:have]
        return size

    def set_many(self, items: list[tuple[bytes, memoryview]]) -> None:
        pieces: list = []
        for key, value in items:
            pieces += [set_head(key, value.nbytes), value, b"\r\n"]
        _sendmsg_all(self.sock, pieces)
        self._replies(OK * len(items))


class PreviousOnBlockingSocket(PreviousReference):
    """The previous reference as it was: on a blocking socket."""

    def __init__(self, host: str, port: int, max_value: int) -> None:
        super().__init__(host, port, max_value)
        self.sock.settimeout(None)


class HiredisClient:
    """hiredis's reader over a raw socket: each reply parsed by hiredis (into a new ``bytes``)."""

    def __init__(self, host: str, port: int, max_value: int) -> None:
        import hiredis

        self.sock = _connect(host, port)
        self.reader = hiredis.Reader()
        self.buffer = bytearray(1024 * 1024)
        self.view = memoryview(self.buffer)

    def get_many(self, keys: list[bytes]) -> int:
        self.sock.sendall(get_frames(keys))
        return sum(len(self._reply()) for _ in keys)

    def set_many(self, items: list[tuple[bytes, memoryview]]) -> None:
        for key, value in items:
            _sendmsg_all(self.sock, [set_head(key, value.nbytes), value, b"\r\n"])
        for _ in items:
            self._reply()

    def _reply(self):  # noqa: ANN202 - whatever hiredis makes of it
        while (reply := self.reader.gets()) is False:
            self.reader.feed(self.view, 0, _got(self.sock.recv_into(self.view)))
        return reply

    def close(self) -> None:
        self.sock.close()


# --references: the bare clients the reference was chosen over, each as a load and a store mode
REFERENCES: dict[str, type] = {
    "previous reference": PreviousOnBlockingSocket,
    "previous, timeout socket": PreviousReference,
    "blocking socket": BlockingClient,
    "blocking, WAITALL, one sendmsg": WaitAllClient,
    "hiredis reader": HiredisClient,
}


def _hiredis() -> bool:
    try:
        import hiredis  # noqa: F401
    except ImportError:
        return False
    return True


class Case:
    """One chunk size: its keys stored, every mode ready to run over them."""

    def __init__(self, url: str, chunk_bytes: int, batches: int, references: bool = False) -> None:
        self.chunk_bytes = chunk_bytes
        self.blocks = chunk_bytes // (LAYERS * BLOCK_BYTES)
        kv = torch.zeros(LAYERS, self.blocks, BLOCK_BYTES // 2, dtype=torch.float16)
        self.copier = BlockCopier({f"layer.{i}": kv[i] for i in range(LAYERS)}, self.blocks)
        self.tier = RedisTier(
            parse_remote_url(url, environ={}), LAYOUT, key_prefix="kvbench", timeout_s=10.0
        )  # a shared machine stalls a socket past the default 0.5 s now and then
        self.tier.clear()
        self.background = BackgroundTier(self.tier, TierHealth("remote"), timeout_s=30.0)
        self.unlowered = BackgroundTier(self.tier, TierHealth("remote"), timeout_s=30.0, lower_readers=False)
        generator = torch.Generator().manual_seed(chunk_bytes)
        self.payloads = [
            memoryview(torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8, generator=generator).numpy())
            for _ in range(BATCH)
        ]
        tag = chunk_bytes // MB
        self.names = [[f"{tag}m-{b}-{i}" for i in range(BATCH)] for b in range(batches)]
        for names in self.names:
            assert not any(self.tier.put_many(list(zip(names, self.payloads, strict=True))))
        self.keys = [[self.tier.key(n).encode() for n in names] for names in self.names]
        record = memoryview(
            codec.encode_header(self.names[0][0], LAYOUT, self.payloads[0]) + bytes(self.payloads[0])
        )
        self.bare_items = [
            [(b"kvbench-bare:%d-%d" % (b, i), record) for i in range(BATCH)] for b in range(batches)
        ]
        host, port = parse_remote_url(url, environ={}).nodes[0]
        self.bare = BareClient(host, port, record.nbytes)
        self.others = {  # the alternatives to the reference (--references)
            name: client(host, port, record.nbytes)
            for name, client in REFERENCES.items()
            if references and (client is not HiredisClient or _hiredis())
        }
        self.redispy = redis.Redis(host=host, port=port, socket_timeout=30)
        self.parser = "hiredis" if HIREDIS_AVAILABLE else "python"
        self.bytes_per_pass = chunk_bytes * BATCH * batches

    def modes(self) -> dict[str, Callable[[int], None]]:
        """Each mode, run over batch ``b`` of the keys."""
        modes = {
            "bare GET": self.bare_get,
            "tier get_many": self.tier_get,
            "background get_many": self.background_get,
            UNLOWERED: self.unlowered_get,
            "redis-py GET": self.redispy_get,
        }
        for name, client in self.others.items():
            modes[f"bare GET, {name}"] = lambda b, c=client: self._other_get(c, b)
        modes |= {
            "bare SET": self.bare_set,
            "tier put_many": self.tier_put,
            "background put": self.background_put,
        }
        for name, client in self.others.items():
            modes[f"bare SET, {name}"] = lambda b, c=client: c.set_many(self.bare_items[b])
        return modes

    def _other_get(self, client: Any, b: int) -> None:
        assert client.get_many(self.keys[b]) >= self.chunk_bytes * BATCH

    def bare_get(self, b: int) -> None:
        assert self.bare.get_many(self.keys[b]) >= self.chunk_bytes * BATCH

    def tier_get(self, b: int) -> None:
        self._use(self.tier.get_many(self.names[b]))

    def background_get(self, b: int) -> None:
        self._use(list(self.background.get_many(self.names[b])))

    def unlowered_get(self, b: int) -> None:
        self._use(list(self.unlowered.get_many(self.names[b])))

    def redispy_get(self, b: int) -> None:
        pipe = self.redispy.pipeline(transaction=False)
        for key in self.keys[b]:
            pipe.get(key)
        records = zip(pipe.execute(), self.names[b], strict=True)
        self._use([codec.decode(memoryview(r), n, LAYOUT) for r, n in records])

    def _use(self, reads: list) -> None:
        """What the worker does with a read before copying it: a KV payload view, checked."""
        for read in reads:
            if not isinstance(read, memoryview):
                raise RuntimeError(f"read failed: {read!r}")
            payload = self.copier.payload_view(read)
            self.copier.check_payload(payload, self.blocks, 0)

    def bare_set(self, b: int) -> None:
        self.bare.set_many(self.bare_items[b])

    def tier_put(self, b: int) -> None:
        errors = self.tier.put_many(list(zip(self.names[b], self.payloads, strict=True)))
        if any(errors):
            raise RuntimeError(f"put failed: {errors}")

    def background_put(self, b: int) -> None:
        for name, payload in zip(self.names[b], self.payloads, strict=True):
            self.background.put(name, payload)
        if not self.background.drain(60.0):
            raise RuntimeError("background writes did not finish")
        failures = self.background.take_failures()
        if failures:
            raise RuntimeError(f"background put failed: {failures}")

    def close(self) -> None:
        self.background.close()
        self.unlowered.close()
        self.tier.clear()
        self.tier.close()
        self.redispy.delete(*(key for items in self.bare_items for key, _ in items))
        self.bare.close()
        for client in self.others.values():
            client.close()
        self.redispy.close()


def _is_load(mode: str) -> bool:
    return mode in LOADS or mode.startswith("bare GET")


def run_case(case: Case, rounds: int) -> dict:
    """Per round, each batch is read by every load mode, then written by every store mode, each
    group in a random order (seeded), so the modes share the machine's moods; a mode's rate for
    the round is over all its batches.

    Not one fixed order rotated: there each mode mostly ran right after the same one, and the
    load mode that followed the stores ran up to 1.3x slower than the other bare clients,
    whichever client held that place (seen with --references)."""
    modes = case.modes()
    order = list(modes)
    loads = [mode for mode in order if _is_load(mode)]
    stores = [mode for mode in order if not _is_load(mode)]
    shuffle = random.Random(case.chunk_bytes).shuffle
    batches = range(len(case.names))
    for mode in order:  # a warm-up pass each: connections, buffers, page cache
        for b in batches:
            modes[mode](b)
    rates: dict[str, list[float]] = {mode: [] for mode in order}
    for _ in range(rounds):
        seconds = dict.fromkeys(order, 0.0)
        for b in batches:
            shuffle(loads)
            shuffle(stores)
            for mode in loads + stores:
                start = time.perf_counter()
                modes[mode](b)
                seconds[mode] += time.perf_counter() - start
        for mode in order:
            rates[mode].append(case.bytes_per_pass / seconds[mode])
    ratios, spread = {}, {}
    for mode in order:
        reference = "bare GET" if _is_load(mode) else "bare SET"
        if mode != reference:
            per_round = [a / b for a, b in zip(rates[mode], rates[reference], strict=True)]
            ratios[mode] = statistics.median(per_round)
            spread[mode] = (min(per_round), max(per_round))
    return {
        "chunk_mib": case.chunk_bytes / MB,
        "batch": BATCH,
        "rounds": rounds,
        "redis_py_parser": case.parser,
        "gb_per_s": {mode: statistics.median(v) / 1e9 for mode, v in rates.items()},
        "ratio_to_bare": ratios,
        "ratio_range": spread,  # min and max of the rounds' ratios
        "all_gb_per_s": {mode: [x / 1e9 for x in v] for mode, v in rates.items()},
    }


def print_table(results: list[dict]) -> None:
    for res in results:
        print(
            f"\n{res['chunk_mib']:g} MiB chunks, batches of {res['batch']}, "
            f"median of {res['rounds']} rounds (redis-py parser: {res['redis_py_parser']})"
        )
        print(f"  {'mode':42s} {'GB/s':>7s} {'x bare':>7s}  rounds' min..max")
        for mode, rate in res["gb_per_s"].items():
            ratio = res["ratio_to_bare"].get(mode)
            low, high = res["ratio_range"].get(mode, (None, None))
            spread = "" if low is None else f"  {low:.2f}..{high:.2f}"
            print(f"  {mode:42s} {rate:7.2f} {'' if ratio is None else f'{ratio:6.2f}x':>7s}{spread}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="an existing redis-server (default: start a private one)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--batches", type=int, default=8, help="batches of 8 chunks per round")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 1 batch")
    parser.add_argument(
        "--references",
        action="store_true",
        help="also run the bare clients the reference was chosen over (hiredis's when installed)",
    )
    parser.add_argument("--sizes", default="4,1", help="chunk sizes in MiB, comma-separated")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rounds, batches = (2, 1) if args.quick else (args.rounds, args.batches)
    load_before = os.getloadavg()
    with private_server() if args.url is None else _given(args.url) as url:
        results = []
        for mib in args.sizes.split(","):
            case = Case(url, int(float(mib) * MB), batches, args.references)
            try:
                results.append(run_case(case, rounds))
            finally:
                case.close()
    load = {"before": load_before, "after": os.getloadavg(), "cores": os.cpu_count()}
    print_table(results)
    print(
        f"\nload average (1, 5, 15 min) before {load['before']}, after {load['after']}, {load['cores']} cores"
    )
    if args.out:
        report = {"bench": "remote_tier_vs_bare", "load_average": load, "results": results}
        args.out.write_text(json.dumps(report, indent=2) + "\n")


@contextmanager
def _given(url: str) -> Iterator[str]:
    yield url


if __name__ == "__main__":
    main()
