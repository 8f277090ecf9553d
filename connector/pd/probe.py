"""The handshake a sender makes, and a probe of a decoder rank that allocates nothing.

``shake_hands`` runs the sender's side of the handshake (``wire.py``): nonces, the receiver's
proof checked first when the sender has a key (``auth.py``), then the sender's proof and
identity; it returns what the receiver said and the connection's chunk trailers.
``probe_receiver`` does the same on a decoder rank's alloc port and reads the receiver's buffer
capacity and free bytes: what ``kvlens doctor`` needs to say whether a prefiller and a decoder
can pair, and what differs when not.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import Any

from . import wire
from .auth import NONCE_BYTES, ChunkTags, PDAuth, new_nonce
from .identity import PeerIdentity, mismatch_reason
from .tls import ClientTLS
from .wire import Checksums, Deadline, FrameType, WireError

log = logging.getLogger(__name__)

AUTH_FAILED = "auth_failed"


@dataclass(frozen=True, slots=True)
class ProbeResult:
    ok: bool  # the two can pair
    reason: (
        str | None
    )  # "unreachable", "timeout", "peer_closed", "bad_frame", "auth_failed", "mismatch:<fields>"
    identity: PeerIdentity | None  # the receiver's, when it answered
    capacity_bytes: int
    free_bytes: int


@dataclass(frozen=True, slots=True)
class Handshake:
    theirs: PeerIdentity | None  # None when the receiver refused before saying who it is
    reply: dict[str, Any]  # the receiver's last answer (ok, reason, capacity_bytes, free_bytes)
    differ: list[str]  # fields that differ as we see them ("version" included)
    trailers: ChunkTags | Checksums  # how this connection's chunks are tagged


def read_reply(conn: socket.socket, io_timeout_s: float, deadline: Deadline | None = None) -> dict[str, Any]:
    kind, body = wire.recv_frame(conn, deadline or Deadline(io_timeout_s), io_timeout_s)
    if kind is not FrameType.REPLY:
        raise WireError("bad_frame", f"{kind.name} where REPLY was expected")
    return wire.decode_control(body)


def shake_hands(
    conn: socket.socket, identity: PeerIdentity, io_timeout_s: float, auth: PDAuth | None = None
) -> Handshake:
    """The sender's side, bounded by ``io_timeout_s`` in all. With ``auth``, a receiver that does
    not prove the key ends it as ``auth_failed`` before our identity is sent."""
    deadline = Deadline(io_timeout_s)
    mine = new_nonce()
    hello = {"version": wire.VERSION, "nonce": mine}
    wire.send_all(conn, [wire.control_frame(FrameType.HELLO, hello)], io_timeout_s, deadline)
    first = read_reply(conn, io_timeout_s, deadline)
    if first.get("version") != wire.VERSION:
        return Handshake(None, first, ["version"], Checksums())
    theirs_nonce = first.get("nonce")
    if not isinstance(theirs_nonce, bytes) or len(theirs_nonce) != NONCE_BYTES:
        raise WireError("bad_frame", "no nonce in the receiver's answer")
    if auth is not None and not auth.check("receiver", mine, theirs_nonce, first.get("proof")):
        raise WireError(AUTH_FAILED, "the receiver did not prove the PD key")
    proof = auth.proof("sender", mine, theirs_nonce) if auth is not None else None
    body = {"identity": identity.to_wire(), "proof": proof}
    wire.send_all(conn, [wire.control_frame(FrameType.AUTH, body)], io_timeout_s, deadline)
    reply = read_reply(conn, io_timeout_s, deadline)
    if reply.get("reason") == AUTH_FAILED:
        return Handshake(None, reply, [], Checksums())
    try:
        theirs = PeerIdentity.from_wire(reply.get("identity"))
    except ValueError as e:
        raise WireError("bad_frame", str(e)) from None
    trailers = auth.session(mine, theirs_nonce) if auth is not None else Checksums()
    return Handshake(theirs, reply, identity.differences(theirs), trailers)


def refusal(shake: Handshake) -> str | None:
    """The handshake's refusal reason (our own naming of the fields first), or None."""
    if shake.differ:
        return mismatch_reason(shake.differ)
    if not shake.reply.get("ok"):
        return known_reason(shake.reply.get("reason"))
    return None


# What a receiver may answer; anything else it says is "bad_reply" (a peer chooses no label).
RECEIVER_REASONS = frozenset({"buffer_full", "too_large", "checksum", AUTH_FAILED, "mismatch"})


def known_reason(value: object) -> str:
    """A receiver's refusal reason as one of a fixed set: ``mismatch:<fields>`` keeps the fields
    only when each is a field name of ours."""
    text = value if isinstance(value, str) else ""
    head, _, fields = text.partition(":")
    if head == "mismatch":
        names = {"version", *PeerIdentity.__dataclass_fields__}
        listed = fields.split(",") if fields else []
        return mismatch_reason(listed) if listed and all(f in names for f in listed) else "mismatch"
    return head if head in RECEIVER_REASONS and not fields else "bad_reply"


def probe_receiver(
    host: str,
    alloc_port: int,
    identity: PeerIdentity,
    timeout_s: float = 2.0,
    auth: PDAuth | None = None,
    tls: ClientTLS | None = None,
) -> ProbeResult:
    """Can ``identity`` pair with the receiver at ``host:alloc_port``? Bounded by ``timeout_s``."""
    try:
        conn = socket.create_connection((host, alloc_port), timeout=timeout_s)
    except OSError:
        return ProbeResult(False, "unreachable", None, 0, 0)
    try:
        if tls is not None:
            conn = tls.wrap(conn, host, timeout_s)
        shake = shake_hands(conn, identity, timeout_s, auth)
    except WireError as e:
        return ProbeResult(False, e.reason, None, 0, 0)
    except OSError:  # the TLS handshake failed
        return ProbeResult(False, "tls_failed", None, 0, 0)
    finally:
        conn.close()
    capacity, free = shake.reply.get("capacity_bytes"), shake.reply.get("free_bytes")
    reason = refusal(shake)
    return ProbeResult(
        reason is None,
        reason,
        shake.theirs,
        capacity if type(capacity) is int else 0,
        free if type(free) is int else 0,
    )
