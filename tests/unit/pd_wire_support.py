"""Shared pieces of the PD data-plane tests (tests/unit/test_pd_wire_*, test_pd_receiver_*,
test_pd_sender_*): identities, a receiver on loopback, records, a send that waits for its end,
and the checks that nothing leaked."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

from connector.pd import wire
from connector.pd.auth import PDAuth, new_nonce
from connector.pd.identity import PeerIdentity
from connector.pd.receiver import PDReceiver
from connector.pd.sender import PDSender, SendOutcome, Transfer

HOST = "127.0.0.1"
WAIT_S = 30.0  # a bound for the test itself, never a speed


def identity(rank: int = 0, tp: int = 1, **changes: object) -> PeerIdentity:
    base = PeerIdentity(
        key_space="ks-0123abcd",
        tp_size=tp,
        tp_rank=rank,
        block_size=16,
        chunk_size=256,
        record_layout="bf16/l4/kvh2/hd64/v1",
    )
    return replace(base, **changes)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def pd_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvlens-pd")]


@contextlib.contextmanager
def receiver(tp: int = 1, buffer_bytes: int = 1 << 20, **kw: object) -> Iterator[PDReceiver]:
    kw.setdefault("transfer_timeout_s", 5.0)
    kw.setdefault("unclaimed_timeout_s", 60.0)
    rx = PDReceiver(
        [identity(r, tp) for r in range(tp)],
        HOST,
        [0] * tp,
        [0] * tp,
        buffer_bytes,
        **kw,  # type: ignore[arg-type]
    )
    rx.start()
    try:
        yield rx
    finally:
        rx.close()


def records(n: int, size: int, last: int, seed: int = 0) -> list[bytes]:
    """``n`` records of ``size`` bytes, the last one ``last`` bytes (an unfull tail)."""
    rnd = __import__("random").Random(seed)
    return [rnd.randbytes(size) for _ in range(n - 1)] + [rnd.randbytes(last)]


class Done:
    """An ``on_done`` that remembers its outcomes and lets the test wait for them."""

    def __init__(self) -> None:
        self.outcomes: list[SendOutcome] = []
        self.threads: list[str] = []
        self._event = threading.Event()

    def __call__(self, outcome: SendOutcome) -> None:
        self.outcomes.append(outcome)
        self.threads.append(threading.current_thread().name)
        self._event.set()

    def wait(self, timeout: float = WAIT_S) -> SendOutcome:
        assert self._event.wait(timeout), "the transfer never ended"
        return self.outcomes[0]


def transfer(
    rx_port: int,
    chunks: list[bytes],
    req_id: str = "proxy-1",
    keys: list[str] | None = None,
    tokens: int = 256,
) -> tuple[Transfer, Done]:
    done = Done()
    keys = keys or [f"{req_id}-k{i}" for i in range(len(chunks))]
    t = Transfer(
        req_id=req_id,
        request_id=f"prefill-{req_id}",
        host=HOST,
        init_port=rx_port,
        alloc_port=0,
        chunks=[(k, memoryview(c), tokens) for k, c in zip(keys, chunks, strict=True)],
        on_done=done,
    )
    return t, done


def send(sender: PDSender, rx_port: int, chunks: list[bytes], **kw: object) -> SendOutcome:
    t, done = transfer(rx_port, chunks, **kw)  # type: ignore[arg-type]
    sender.send(t)
    return done.wait()


def assert_idle(rx: PDReceiver) -> None:
    """Nothing held: no slot, no entry, no transfer in flight."""
    s = rx.stats()
    assert (s.used_bytes, s.entries, s.in_flight, s.claims) == (0, 0, 0, 0), s


def wait_until(check, timeout: float = WAIT_S, what: str = "condition") -> None:  # type: ignore[no-untyped-def]
    """Poll ``check`` until true; fail past ``timeout`` (a bound, never a speed)."""
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, f"{what} not reached within {timeout} s"
        time.sleep(0.01)


class RawPeer:
    """A hand-driven sender: writes whatever frames (or garbage) a test wants."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection((HOST, port), timeout=WAIT_S)

    def send(self, *pieces: bytes) -> None:
        for p in pieces:
            self.sock.sendall(p)

    def hello(self, ident: PeerIdentity | None = None, auth: PDAuth | None = None) -> dict:
        """The whole handshake as a sender makes it (proving ``auth``'s key when given); the
        receiver's last answer. ``first`` keeps its first answer (nonce, proof)."""
        self.nonce = new_nonce()
        self.send(wire.control_frame(wire.FrameType.HELLO, {"version": wire.VERSION, "nonce": self.nonce}))
        self.first = self.reply()
        theirs = self.first.get("nonce")
        proof = auth.proof("sender", self.nonce, theirs) if auth is not None else None
        body = {"identity": (ident or identity()).to_wire(), "proof": proof}
        self.send(wire.control_frame(wire.FrameType.AUTH, body))
        answer = self.reply()
        self.trailers = auth.session(self.nonce, theirs) if auth is not None else wire.Checksums()
        return answer

    def alloc(self, lengths: list[int], keys: list[str] | None = None, req_id: str = "raw") -> dict:
        keys = keys or [f"{req_id}-{i}" for i in range(len(lengths))]
        body = {"req_id": req_id, "keys": keys, "lengths": lengths, "tokens": [256] * len(lengths)}
        self.seq = getattr(self, "seq", -1) + 1
        self.transfer = (req_id, keys)
        self.send(wire.control_frame(wire.FrameType.ALLOC, body))
        return self.reply()

    def chunk(self, index: int, data: bytes, digest: int | None = None) -> None:
        """A CHUNK frame with its trailer as this connection's sender computes it, or with the
        xxh3 ``digest`` given (a wrong one, say)."""
        if digest is not None:
            trailer = wire.chunk_trailer(digest)
        else:
            req_id, keys = self.transfer
            trailer = self.trailers.tag(self.seq, req_id, keys[index], index, 256, memoryview(data))
        self.send(wire.chunk_header(index, len(data)), data, trailer)

    def end(self) -> dict:
        self.send(wire.control_frame(wire.FrameType.END, {}))
        return self.reply()

    def reply(self) -> dict:
        kind, body = wire.recv_frame(self.sock, wire.Deadline(WAIT_S), WAIT_S)
        assert kind is wire.FrameType.REPLY
        return wire.decode_control(body)

    def closed_by_peer(self, timeout: float = WAIT_S) -> bool:
        """True once the receiver has closed its end (EOF or reset), waiting at most ``timeout``."""
        self.sock.settimeout(timeout)
        try:
            while self.sock.recv(65536):
                pass
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        self.sock.close()


def answer_handshake(
    conn: socket.socket,
    ident: PeerIdentity | None = None,
    auth: PDAuth | None = None,
    timeout: float = WAIT_S,
) -> wire.Checksums | object:
    """A hand-made decoder's side of the handshake on ``conn`` (accepting whoever comes, proving
    ``auth``'s key when given); the connection's chunk trailers."""
    d = wire.Deadline(timeout)
    _, body = wire.recv_frame(conn, d, timeout)
    theirs, mine = wire.decode_control(body)["nonce"], new_nonce()
    proof = auth.proof("receiver", theirs, mine) if auth is not None else None
    conn.sendall(
        wire.control_frame(wire.FrameType.REPLY, {"version": wire.VERSION, "nonce": mine, "proof": proof})
    )
    wire.recv_frame(conn, d, timeout)
    ok = {"ok": True, "reason": None, "identity": (ident or identity()).to_wire(), "capacity_bytes": 1 << 30}
    conn.sendall(wire.control_frame(wire.FrameType.REPLY, {**ok, "free_bytes": 1 << 30}))
    return auth.session(theirs, mine) if auth is not None else wire.Checksums()


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def spawn(code: str, *args: str, ready: str = "ready") -> subprocess.Popen:
    """A Python child running ``code`` (the repository importable), returned once it printed
    ``ready``: it has reached the point the test waits for."""
    env = {**os.environ, "PYTHONPATH": REPO}
    child = subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO
    )
    line = child.stdout.readline()  # type: ignore[union-attr]
    assert line.strip() == ready, f"child said {line!r}"
    return child


def kill(child: subprocess.Popen) -> None:
    child.send_signal(signal.SIGKILL)
    child.wait(WAIT_S)
    child.stdout.close()  # type: ignore[union-attr]


@dataclass(frozen=True)
class TLSFilesForTests:
    cert: str  # a self-signed certificate for 127.0.0.1 (its own CA), key in ``key``
    key: str
    other: str  # another self-signed certificate: a CA that did not sign ``cert``


def self_signed(directory: str, name: str) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and localhost, and its key, as PEM files."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    alt = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address(HOST))])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(alt, critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = os.path.join(directory, f"{name}.pem"), os.path.join(directory, f"{name}.key")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return cert_path, key_path


def tls_files_in(directory: str) -> TLSFilesForTests:
    cert, key = self_signed(directory, "decoder")
    other, _ = self_signed(directory, "stranger")
    return TLSFilesForTests(cert, key, other)
