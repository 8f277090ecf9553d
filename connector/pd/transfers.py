"""What a transfer is to the receiver: its allocation checked, its chunks and their trailers, and
what is counted when it ends. Pure: sockets and threads stay in ``receiver.py``."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import wire
from .auth import ChunkTags
from .receive_buffer import Slot
from .wire import Checksums, RunningCheck, WireError


@dataclass(frozen=True, slots=True)
class FinishedTransfer:
    rank: int
    req_id: str
    ok: bool
    reason: str | None
    bytes: int
    seconds: float  # first chunk byte to the last (0 when no chunk arrived)


@dataclass(frozen=True, slots=True)
class ReceiverStats:
    capacity_bytes: int  # all ranks
    used_bytes: int  # slots held: indexed records and transfers in flight
    entries: int  # indexed keys (the leak gauge: 0 when idle)
    claims: int
    in_flight: int  # transfers allocated and not yet indexed or failed
    connections: int
    received_bytes: int  # bytes of transfers indexed
    receive_seconds: float  # their first byte to last, summed
    transfers: dict[str, int] = field(default_factory=dict)  # outcome ("ok", "failed") -> count
    failed: dict[str, int] = field(default_factory=dict)  # reason -> count (refusals included)
    expired: int = 0  # entries nobody claimed in time
    released: int = 0  # entries freed after their load was reported
    duplicates: int = 0  # records received again while held (freed at once)
    evicted: int = 0  # idle connections closed to admit another


@dataclass(frozen=True, slots=True)
class TransferChunks:
    """One transfer's chunks as allocated, and how their trailers are checked."""

    seq: int  # the transfer's number on its connection
    req_id: str
    keys: list[str]
    tokens: list[int]
    slots: list[Slot]
    trailers: ChunkTags | Checksums

    def begin(self, index: int) -> RunningCheck:
        """Chunk ``index``'s trailer as the receiver computes it while its bytes land."""
        length = self.slots[index].length
        return self.trailers.begin(self.seq, self.req_id, self.keys[index], index, self.tokens[index], length)


def parse_alloc(body: dict) -> tuple[str, list[str], list[int], list[int]]:
    req_id, keys, lengths, tokens = (body.get(k) for k in ("req_id", "keys", "lengths", "tokens"))
    ok = (
        isinstance(req_id, str)
        and len(req_id) <= wire.MAX_KEY_CHARS
        and isinstance(keys, list)
        and isinstance(lengths, list)
        and isinstance(tokens, list)
        and 0 < len(keys) == len(lengths) == len(tokens)
        and all(isinstance(k, str) and 0 < len(k) <= wire.MAX_KEY_CHARS for k in keys)
        and all(type(n) is int and 0 < n < 2**40 for n in lengths)
        and all(type(n) is int and 0 <= n < 2**31 for n in tokens)
        and len(set(keys)) == len(keys)
    )
    if not ok:
        raise WireError("bad_frame", "malformed ALLOC")
    return req_id, keys, lengths, tokens
