"""What the decoder has received: verified records by chunk key and rank, claims, expiry.

Lives in the scheduler process beside the lookup, so a lookup never races an arrival: a transfer
is indexed whole (every chunk verified) or not at all. Records are never overwritten: a resend of
keys already held lands in fresh slots and is freed at indexing (the held bytes stay).

**The scheduler never waits for a receiver.** The index's lock guards entries, claims and
deadlines only. A record's slot leaves the index under that lock (its entry is taken out, so one
caller alone holds the slot) and goes back to its buffer after the lock is released, through
``ReceiveBuffer.free_soon``, which never waits for the buffer's lock. So a slot is freed once, and
only after its entry is gone; an entry a claim pins goes only at its claim's ``release`` (or
``drop_all`` at shutdown), so a claimed record's slot cannot change or be reused before then.

**Expiry.** An entry's clock starts when its key is first indexed and starts once more when the
last rank's record arrives (from then a decoder request can use it); a resend never moves it, so
a peer re-sending keys cannot keep them: an unclaimed key is gone within twice the timeout of its
first arrival. Deadlines wait in a heap, so ``expire`` costs what it frees, not what is held.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .receive_buffer import ReceiveBuffer, Slot


@dataclass(frozen=True, slots=True)
class RecordLocation:
    buffer_name: str  # attach() this on the worker of the rank
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class TransferFacts:
    req_id: str  # the proxy's id, as the prefiller's disagg_spec named it
    bytes: int
    transfer_ms: float  # first chunk byte to the last
    indexed_at: float  # the index's clock


@dataclass(frozen=True, slots=True)
class Claim:
    request_id: str  # the decoder's request that claimed
    keys: tuple[str, ...]  # the leading keys claimed (every rank has each)
    locations: tuple[tuple[RecordLocation, ...], ...]  # [key index][rank]
    tokens: int
    bytes: int  # over every rank
    transfer_ms: float  # the longest of the transfers that brought these records
    received_at: float  # when the last of them was indexed (the index's clock)
    req_id: str  # the proxy's id of the transfer that brought the last key to rank 0


@dataclass(slots=True)
class _Held:
    slot: Slot
    facts: TransferFacts


@dataclass(slots=True)
class _Entry:
    tokens: int
    since: float  # first indexed, then when every rank has it; never moved by a resend
    ranks: dict[int, _Held] = field(default_factory=dict)
    pins: int = 0


class ReceiveIndex:
    """Thread-safe; every method is short and never waits on I/O."""

    def __init__(
        self, buffers: Sequence[ReceiveBuffer], unclaimed_timeout_s: float, clock: Callable[[], float]
    ) -> None:
        self._buffers = list(buffers)
        self._unclaimed_s = unclaimed_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._claims: dict[str, Claim] = {}
        self._deadlines: list[tuple[float, str]] = []  # (since, key); stale ones are skipped
        self.expired = 0
        self.released = 0
        self.duplicates = 0

    def clock(self) -> float:
        return self._clock()

    def add(
        self,
        rank: int,
        keys: Sequence[str],
        tokens: Sequence[int],
        slots: Sequence[Slot],
        facts: TransferFacts,
    ) -> None:
        """Index a verified transfer to ``rank``; slots of records already held are freed.

        ``ValueError`` (and nothing indexed) when keys, token counts and slots disagree in number."""
        if not len(keys) == len(tokens) == len(slots):
            raise ValueError(f"{len(keys)} keys, {len(tokens)} token counts, {len(slots)} slots")
        unused: list[Slot] = []
        with self._lock:
            for key, n, slot in zip(keys, tokens, slots, strict=True):
                if not self._add_record(rank, key, n, slot, facts):
                    unused.append(slot)
            self.duplicates += len(unused)
        self._buffers[rank].free_soon(unused)

    def _add_record(self, rank: int, key: str, tokens: int, slot: Slot, facts: TransferFacts) -> bool:
        """Whether the record was kept (not when its rank has the key, or the key disagrees)."""
        entry = self._entries.get(key)
        if entry is not None and (rank in entry.ranks or entry.tokens != tokens):
            return False
        if entry is None:
            entry = self._entries[key] = _Entry(tokens, facts.indexed_at)
            heapq.heappush(self._deadlines, (entry.since, key))
        entry.ranks[rank] = _Held(slot, facts)
        if len(entry.ranks) == len(self._buffers) and entry.since != facts.indexed_at:
            entry.since = facts.indexed_at  # whole now: its wait for a claim starts
            heapq.heappush(self._deadlines, (entry.since, key))
        return True

    def present(self, keys: Sequence[str]) -> int:
        with self._lock:
            return self._present(keys)

    def _present(self, keys: Sequence[str]) -> int:
        ranks = len(self._buffers)
        n = 0
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or len(entry.ranks) != ranks:
                break
            n += 1
        return n

    def claim(self, keys: Sequence[str], request_id: str) -> Claim | None:
        """Pin the leading present keys for ``request_id``'s load (its claim if it has one)."""
        with self._lock:
            if request_id in self._claims:
                return self._claims[request_id]
            n = self._present(keys)
            if n == 0:
                return None
            entries = [self._entries[k] for k in keys[:n]]
            for entry in entries:
                entry.pins += 1
            facts = {id(h.facts): h.facts for e in entries for h in e.ranks.values()}.values()
            last = entries[-1].ranks[0].facts
            claim = Claim(
                request_id=request_id,
                keys=tuple(keys[:n]),
                locations=tuple(
                    tuple(
                        RecordLocation(self._buffers[r].name, e.ranks[r].slot.offset, e.ranks[r].slot.length)
                        for r in range(len(self._buffers))
                    )
                    for e in entries
                ),
                tokens=sum(e.tokens for e in entries),
                bytes=sum(h.slot.length for e in entries for h in e.ranks.values()),
                transfer_ms=max(f.transfer_ms for f in facts),
                received_at=max(f.indexed_at for f in facts),
                req_id=last.req_id,
            )
            self._claims[request_id] = claim
            return claim

    def release(self, request_id: str) -> None:
        """The load was reported (any outcome): unpin, and free what no other claim holds."""
        freed: list[tuple[int, Slot]] = []
        with self._lock:
            claim = self._claims.pop(request_id, None)
            if claim is None:
                return
            for key in claim.keys:
                entry = self._entries[key]
                entry.pins -= 1
                if entry.pins == 0:
                    freed += self._take(key)
                    self.released += 1
        self._free(freed)

    def expire(self) -> int:
        """Free unclaimed entries that waited the unclaimed timeout; how many."""
        freed: list[tuple[int, Slot]] = []
        n = 0
        with self._lock:
            cutoff = self._clock() - self._unclaimed_s
            while self._deadlines and self._deadlines[0][0] <= cutoff:
                since, key = heapq.heappop(self._deadlines)
                entry = self._entries.get(key)
                if entry is not None and entry.since == since and entry.pins == 0:
                    freed += self._take(key)
                    n += 1
                # else: gone, restarted (a later deadline waits), or claimed (release frees it)
            self.expired += n
            self._compact_deadlines()
        self._free(freed)
        return n

    def drop_all(self) -> None:
        freed: list[tuple[int, Slot]] = []
        with self._lock:
            for key in list(self._entries):
                freed += self._take(key)
            self._claims.clear()
            self._deadlines.clear()
        self._free(freed)

    def _take(self, key: str) -> list[tuple[int, Slot]]:
        """Take the entry out of the index (under the lock): its slots are the caller's to free."""
        return [(rank, held.slot) for rank, held in self._entries.pop(key).ranks.items()]

    def _free(self, freed: list[tuple[int, Slot]]) -> None:
        """Give slots back to their buffers, outside the index's lock and without waiting."""
        for rank, buffer in enumerate(self._buffers):
            slots = [slot for r, slot in freed if r == rank]
            if slots:
                buffer.free_soon(slots)

    def _compact_deadlines(self) -> None:
        """Forget deadlines of entries already gone once they outnumber the live ones, so memory
        follows what is held even when the timeout is long and most entries go by ``release``."""
        if len(self._deadlines) > 2 * len(self._entries) + 1024:
            self._deadlines = [(e.since, k) for k, e in self._entries.items()]
            heapq.heapify(self._deadlines)

    def counts(self) -> tuple[int, int]:
        """(entries, claims)."""
        with self._lock:
            return len(self._entries), len(self._claims)
