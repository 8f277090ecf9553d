"""The handshake a sender makes, and a probe of a decoder rank that allocates nothing.

``probe_receiver`` connects to a decoder rank's alloc port, exchanges identities and reads the
receiver's buffer capacity and free bytes: what ``kvlens doctor`` needs to say whether a prefiller
and a decoder can pair, and what differs when not.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import Any

from . import wire
from .identity import PeerIdentity, mismatch_reason
from .wire import Deadline, FrameType, WireError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProbeResult:
    ok: bool  # the two can pair
    reason: str | None  # "unreachable", "timeout", "peer_closed", "bad_frame", "mismatch:<fields>"
    identity: PeerIdentity | None  # the receiver's, when it answered
    capacity_bytes: int
    free_bytes: int


def read_reply(conn: socket.socket, io_timeout_s: float) -> dict[str, Any]:
    kind, body = wire.recv_frame(conn, Deadline(io_timeout_s), io_timeout_s)
    if kind is not FrameType.REPLY:
        raise WireError("bad_frame", f"{kind.name} where REPLY was expected")
    return wire.decode_control(body)


def shake_hands(
    conn: socket.socket, identity: PeerIdentity, io_timeout_s: float
) -> tuple[PeerIdentity, dict[str, Any], list[str]]:
    """Send our identity, read the receiver's: (its identity, its reply, the fields that differ
    as we see them, "version" included when the wire versions differ)."""
    hello = {"identity": identity.to_wire(), "version": wire.VERSION}
    wire.send_all(conn, [wire.control_frame(FrameType.HELLO, hello)], io_timeout_s)
    reply = read_reply(conn, io_timeout_s)
    try:
        theirs = PeerIdentity.from_wire(reply.get("identity"))
    except ValueError as e:
        raise WireError("bad_frame", str(e)) from None
    differ = identity.differences(theirs)
    if reply.get("version") != wire.VERSION:
        differ.append("version")
    return theirs, reply, differ


def refusal(reply: dict[str, Any], differ: list[str]) -> str | None:
    """The handshake's refusal reason (our own naming of the fields first), or None."""
    if differ:
        return mismatch_reason(differ)
    if not reply.get("ok"):
        return str(reply.get("reason"))
    return None


def probe_receiver(host: str, alloc_port: int, identity: PeerIdentity, timeout_s: float = 2.0) -> ProbeResult:
    """Can ``identity`` pair with the receiver at ``host:alloc_port``? Bounded by ``timeout_s``."""
    try:
        conn = socket.create_connection((host, alloc_port), timeout=timeout_s)
    except OSError:
        return ProbeResult(False, "unreachable", None, 0, 0)
    try:
        theirs, reply, differ = shake_hands(conn, identity, timeout_s)
    except WireError as e:
        return ProbeResult(False, e.reason, None, 0, 0)
    finally:
        conn.close()
    capacity, free = reply.get("capacity_bytes"), reply.get("free_bytes")
    reason = refusal(reply, differ)
    return ProbeResult(
        reason is None,
        reason,
        theirs,
        capacity if type(capacity) is int else 0,
        free if type(free) is int else 0,
    )
