"""Shared pieces of the PD data-plane tests (tests/unit/test_pd_wire_*, test_pd_receiver_*,
test_pd_sender_*): identities, a receiver on loopback, records, a send that waits for its end,
and the checks that nothing leaked."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import replace

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
