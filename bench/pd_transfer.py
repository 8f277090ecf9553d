"""PD transfer speed: a prompt's chunks from PDSender to PDReceiver, against a bare TCP socket
copying the same bytes on loopback, side by side.

    python bench/pd_transfer.py [--quick] [--rounds N] [--chunks 16] [--chunk-kib 4096]
                                [--modes bare,bare-xxh3,pd,pd-tag,pd-tls] [--out DIR]

The receiving side runs in a child process, as the decoder's scheduler does (never in the
sender's process, whose GIL it would share); the parent sends. A round is one prompt: ``--chunks``
records of ``--chunk-kib`` KiB, the last one ``--tail-kib`` (the unfull tail), from memoryviews
over touched memory. Modes, in turns within every round:

- ``bare``: the reference, as fast as a bare socket gets. One kept connection; per chunk a
  16-byte header then the bytes (``sendall`` of the caller's memoryview), read with one
  ``recv_into(..., MSG_WAITALL)`` each into a touched buffer of the round's size, one byte of
  acknowledgement at the end of the round. No checks.
- ``bare-xxh3``: the same with an xxh3-64 per chunk computed by the sender and checked by the
  receiver (what the checksum alone costs).
- ``pd``: ``PDSender.send`` of the round as one transfer (a kept connection, the ALLOC, CHUNK
  frames, the END and its acknowledgement once every chunk is verified and indexed) until
  ``on_done``; between rounds the child frees the entries (not timed).
- ``pd-tag``: the same between a sender and a receiver sharing a PD key (issue 36): the keyed
  handshake, and an AES-GCM tag per chunk in place of the xxh3 (connector/pd/auth.py).
- ``pd-tls``: ``pd-tag`` inside TLS (a self-signed certificate made for the run; ECDHE and AES-GCM
  as OpenSSL negotiates them): what hiding the prompts' KV from the network costs.

GB/s is the round's bytes over its time; the ratio is each mode over ``bare`` in the same round,
and ``pd-tag`` and ``pd-tls`` are also compared with ``pd`` (the tag's and TLS's own cost).
``CPU ms`` is the CPU time both processes spent on the round (every thread): on a machine busier
than its cores, wall time follows it, so its ratio is the steadier comparison there.
Goals: ``pd`` >= 0.8x ``bare`` (issue 28); the tag costs under 10% of a transfer at 1 MiB chunks
(``pd-tag`` >= 0.9x ``pd``, issue 36; run with ``--chunk-kib 1024``); with the tag on, the
transfer reaches 0.9x ``bare`` (``pd-tag`` >= 0.9x ``bare``, issue 40). ``--modes
bare,pd,pd-tag`` reports the transfer with and without the tag against the bare socket.
Default chunk: 256 tokens of the bench model (8 layers, 8 KV heads, head 128, bf16: 16 KiB per
token, 4 MiB per chunk) plus a record header; --quick uses the tiny model's (2 KiB per token:
512 KiB).
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import xxhash  # noqa: E402

from bench.lib.runner import Benchmark, Figure, Option, Side, Target, main  # noqa: E402
from connector.pd.auth import PDAuth  # noqa: E402
from connector.pd.identity import PeerIdentity  # noqa: E402
from connector.pd.receiver import PDReceiver  # noqa: E402
from connector.pd.sender import PDSender, SendOutcome, Transfer  # noqa: E402
from connector.pd.tls import ClientTLS, ServerTLS, TLSFiles  # noqa: E402

HOST = "127.0.0.1"
TARGET = 0.8
TAG_TARGET = 0.9  # the tag costs under 10% of the transfer
WIRE_TARGET = 0.9  # with the tag, the transfer at 0.9x the bare socket (issue 40)
KEY = b"the bench's PD key, 32 bytes ..."
RECORD_HEADER = 384  # about what a record's header adds to its payload (connector/tiers/codec.py)
IDENTITY = PeerIdentity("bench", 1, 0, 16, 256, "bench/v1")
BARE_HEAD = struct.Struct("<QQ")  # length, xxh3-64 (0 when not checked); length 0 ends a round


# ---- the receiving side (the child) ---------------------------------------------------------------
def _bare_sink(conn: socket.socket, view: memoryview) -> None:
    head = bytearray(BARE_HEAD.size)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        while True:
            if not _read_into(conn, memoryview(head)):
                return
            offset, (length, digest) = 0, BARE_HEAD.unpack(head)
            while length:
                slot = view[offset : offset + length]
                if not _read_into(conn, slot):
                    return
                if digest and xxhash.xxh3_64_intdigest(slot) != digest:
                    raise SystemExit("bare-xxh3: checksum mismatch")
                offset += length
                if not _read_into(conn, memoryview(head)):
                    return
                length, digest = BARE_HEAD.unpack(head)
            conn.sendall(b"k")


def _read_into(conn: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        if n == 0:
            return False
        got += n
    return True


def serve(capacity: int, cert: str, key: str) -> None:
    """The child: PD receivers (no key, a key, a key inside TLS) and a bare sink; prints their
    ports, then frees the PD entries on each ``free`` line of stdin."""
    tls = ServerTLS(TLSFiles(cert, key))
    receivers = {
        "pd": PDReceiver([IDENTITY], HOST, [0], [0], capacity, 30.0, 0.0),
        "pd-tag": PDReceiver([IDENTITY], HOST, [0], [0], capacity, 30.0, 0.0, auth=PDAuth(KEY)),
        "pd-tls": PDReceiver([IDENTITY], HOST, [0], [0], capacity, 30.0, 0.0, auth=PDAuth(KEY), tls=tls),
    }
    for rx in receivers.values():
        rx.start()
    sink = socket.create_server((HOST, 0))
    buf = bytearray(capacity)
    for i in range(0, capacity, 4096):  # touched, as the PD buffer's pages are after its first round
        buf[i] = 1
    threading.Thread(
        target=lambda: [
            threading.Thread(target=_bare_sink, args=(sink.accept()[0], memoryview(buf)), daemon=True).start()
            for _ in iter(int, 1)
        ],
        daemon=True,
    ).start()
    ports = {name: rx.init_ports[0] for name, rx in receivers.items()}
    print(json.dumps({**ports, "bare": sink.getsockname()[1]}), flush=True)
    for line in sys.stdin:
        if line.strip() == "free":
            for rx in receivers.values():
                rx.expire()
            stats = [rx.stats() for rx in receivers.values()]
            failed = {k: v for s in stats for k, v in s.failed.items()}
            print(json.dumps({"used": sum(s.used_bytes for s in stats), "failed": failed}), flush=True)
        elif line.strip() == "cpu":
            print(json.dumps({"cpu": time.process_time()}), flush=True)
    for rx in receivers.values():
        rx.close()


# ---- the sending side (the benchmark) ---------------------------------------------------------------
class PDTransfer(Benchmark):
    name = "pd_transfer"
    figures = (
        Figure("gbps", "GB/s", "{:.2f}", ratio=True),
        Figure("ms", "ms per round", "{:.2f}"),
        Figure("cpu_ms", "CPU ms per round (both ends)", "{:.1f}", ratio=True),
    )
    baselines = ("bare", "pd")
    targets = (
        Target(
            f"PD transfer >= {TARGET} x bare TCP",
            "gbps",
            TARGET,
            at_most=False,
            baseline="bare",
            mode_prefix="pd",
        ),
        Target(
            f"PD transfer with the chunk tag >= {WIRE_TARGET} x bare TCP",
            "gbps",
            WIRE_TARGET,
            at_most=False,
            baseline="bare",
            mode_prefix="pd-tag",
        ),
        Target(
            f"the tag costs < {1 - TAG_TARGET:.0%} of the transfer (pd-tag >= {TAG_TARGET} x pd)",
            "gbps",
            TAG_TARGET,
            at_most=False,
            baseline="pd",
            mode_prefix="pd-tag",
        ),
    )
    repeats = (15, 3)
    repeat_flags = ("--rounds",)
    options = {
        "chunks": Option(16, 4, "chunks per round (a prompt of chunks x 256 tokens)"),
        "chunk_kib": Option(4096, 512, "payload KiB per chunk (256 tokens of the model)"),
        "tail_kib": Option(1600, 200, "payload KiB of the last, unfull chunk"),
    }

    def sides(self) -> list[Side]:
        return [
            Side("bare", "bare TCP: sendall/recv_into, no checks"),
            Side("bare-xxh3", "bare TCP with an xxh3-64 per chunk"),
            Side("pd", "PDSender -> PDReceiver"),
            Side("pd-tag", "PDSender -> PDReceiver with a PD key: keyed handshake, AES-GCM chunk tags"),
            Side("pd-tls", "pd-tag inside TLS"),
        ]

    def compared_with(self, side: str) -> tuple[str, ...]:
        return {"bare": (), "bare-xxh3": ("bare",), "pd": ("bare",)}.get(side, ("bare", "pd"))

    @contextlib.contextmanager
    def setup(self) -> Iterator[None]:
        a = self.args
        sizes = [a.chunk_kib * 1024 + RECORD_HEADER] * (a.chunks - 1) + [a.tail_kib * 1024 + RECORD_HEADER]
        self.total = sum(sizes)
        source = bytearray(self.total)
        source[:] = bytes(range(256)) * (self.total // 256) + bytes(self.total % 256)
        view, offsets = memoryview(source), [sum(sizes[:i]) for i in range(len(sizes))]
        self.chunks = [view[o : o + n] for o, n in zip(offsets, sizes, strict=True)]
        self.digests = [xxhash.xxh3_64_intdigest(c) for c in self.chunks]
        capacity = 2 * self.total + (1 << 20)
        self._certs = tempfile.TemporaryDirectory()
        cert, key = _self_signed(self._certs.name)
        self.child = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(capacity), cert, key],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        ports = json.loads(self.child.stdout.readline())  # type: ignore[union-attr]
        self.ports = {name: ports[name] for name in ("pd", "pd-tag", "pd-tls")}
        self.bare = socket.create_connection((HOST, ports["bare"]))
        self.bare.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        auth, tls = PDAuth(KEY), ClientTLS(TLSFiles(ca_file=cert))
        self.senders = {
            "pd": PDSender(IDENTITY, connect_timeout_s=5.0, io_timeout_s=30.0),
            "pd-tag": PDSender(IDENTITY, connect_timeout_s=5.0, io_timeout_s=30.0, auth=auth),
            "pd-tls": PDSender(IDENTITY, connect_timeout_s=5.0, io_timeout_s=30.0, auth=auth, tls=tls),
        }
        self.round = 0
        try:
            yield
        finally:
            for sender in self.senders.values():
                sender.close()
            self._certs.cleanup()
            self.bare.close()
            self.child.stdin.close()  # type: ignore[union-attr]
            self.child.wait(30)

    def warm_up(self, side: Side) -> None:
        self.measure(side, None, -1)

    def measure(self, side: Side, case: Any, rep: int) -> dict[str, float]:
        cpu = time.process_time() + self._child("cpu")["cpu"]
        if side.name.startswith("pd"):
            seconds = self._pd_round(side.name)
        else:
            seconds = self._bare_round(checked=side.name == "bare-xxh3")
        cpu = time.process_time() + self._child("cpu")["cpu"] - cpu
        if side.name.startswith("pd"):
            freed = self._child("free")  # not timed: the decoder frees after its load
            assert freed["used"] == 0 and not freed["failed"], freed
        return {"gbps": self.total / seconds / 1e9, "ms": seconds * 1e3, "cpu_ms": cpu * 1e3}

    def _child(self, command: str) -> dict[str, Any]:
        self.child.stdin.write(command + "\n")  # type: ignore[union-attr]
        self.child.stdin.flush()  # type: ignore[union-attr]
        return json.loads(self.child.stdout.readline())  # type: ignore[union-attr]

    def _bare_round(self, checked: bool) -> float:
        ack = bytearray(1)
        start = time.perf_counter()
        for chunk in self.chunks:
            digest = xxhash.xxh3_64_intdigest(chunk) if checked else 0
            self.bare.sendall(BARE_HEAD.pack(len(chunk), digest))
            self.bare.sendall(chunk)
        self.bare.sendall(BARE_HEAD.pack(0, 0))
        self.bare.recv_into(ack)
        return time.perf_counter() - start

    def _pd_round(self, mode: str) -> float:
        self.round += 1
        done = threading.Event()
        outcomes: list[SendOutcome] = []

        def on_done(outcome: SendOutcome) -> None:
            outcomes.append(outcome)
            done.set()

        chunks = [(f"r{self.round}-{i}", c, 256) for i, c in enumerate(self.chunks)]
        transfer = Transfer(f"r{self.round}", f"r{self.round}", HOST, self.ports[mode], 0, chunks, on_done)
        start = time.perf_counter()
        self.senders[mode].send(transfer)
        done.wait(60)
        seconds = time.perf_counter() - start
        if not outcomes or not outcomes[0].ok:
            raise SystemExit(f"PD transfer failed: {outcomes}")
        return seconds

    def workload(self) -> dict[str, Any]:
        a = self.args
        return {
            "chunks": a.chunks,
            "chunk_bytes": a.chunk_kib * 1024 + RECORD_HEADER,
            "round_bytes": self.total,
        }


def _self_signed(directory: str) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and its key (PEM files), for the TLS mode."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench decoder")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(HOST))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = f"{directory}/decoder.pem", f"{directory}/decoder.key"
    Path(cert_path).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    Path(key_path).write_bytes(pem)
    return cert_path, key_path


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(int(sys.argv[2]), sys.argv[3], sys.argv[4])
        sys.exit(0)
    sys.exit(main(PDTransfer))
