"""PD work the scheduler hands the workers in a step's metadata, and what they report back
(picklable, no torch): the prefiller's sends, the decoder's loads from its receive buffer."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class PDSendChunk:
    key: str  # chunk key (hex), as the decoder's lookup computes it
    block_ids: tuple[int, ...]  # every block of the chunk, in order
    num_tokens: int


@dataclass(frozen=True, slots=True)
class PDSendJob:
    """Gather a prompt's chunks after this step's forward pass and hand them to the rank's sender."""

    request_id: str
    req_id: str  # the proxy's id (disagg_spec.req_id)
    host: str
    init_ports: tuple[int, ...]  # [rank]
    alloc_ports: tuple[int, ...]
    chunks: tuple[PDSendChunk, ...]
    key_space: str  # the scheduler's digest of what keys depend on besides tokens (identity)
    notify: bool  # PUSH ProxyNotif once the transfer ends
    trace_context: dict[str, str] | None = None
    refused: str | None = None  # nothing to send (a spec refused by reason): only the notice goes out


@dataclass(frozen=True, slots=True)
class PDChunkLoad:
    key: str
    block_ids: tuple[int, ...]  # vLLM blocks to write, in order
    first_block: int  # index, within the record, of the block written to block_ids[0]
    num_tokens: int  # tokens these blocks make valid
    where: tuple[tuple[str, int, int], ...]  # [rank] -> (buffer name, offset, length)


@dataclass(frozen=True, slots=True)
class PDLoadJob:
    """Copy claimed records from the receive buffer into the request's blocks. The request waits
    outside the batch (vLLM's ``WAITING_FOR_REMOTE_KVS``): each rank copies in the step whose
    metadata carries the job and reports the request in that step's ``finished_recving``, with
    the blocks that failed, whatever happened (vLLM holds the request's blocks until then)."""

    request_id: str
    chunks: tuple[PDChunkLoad, ...]
    fail_blocks: tuple[int, ...] = ()  # after the chunks: blocks of records lost before the load
    fail_reason: str | None = None  # why ``fail_blocks`` fail (claim_lost, no_blocks)


@dataclass(slots=True)
class PDLoadResult:
    """One rank's (merged: every rank's) outcome of a PDLoadJob. The scheduler counts the tokens
    loaded from ``failed_block_ids`` (vLLM keeps a load's blocks up to its first failed one)."""

    ok: bool = True
    reason: str | None = None
    failed_block_ids: set[int] = field(default_factory=set)
    tokens: int = 0
    bytes: int = 0

    def merge(self, other: PDLoadResult) -> None:
        self.ok = self.ok and other.ok
        self.reason = self.reason or other.reason
        self.failed_block_ids |= other.failed_block_ids
        self.tokens = (
            min(self.tokens, other.tokens) if self.tokens and other.tokens else max(self.tokens, other.tokens)
        )
        self.bytes += other.bytes


@dataclass(frozen=True, slots=True)
class PDSendReport:
    """A transfer that ended on a worker rank (after the notice, if any, went out)."""

    request_id: str
    req_id: str
    rank: int
    ok: bool
    reason: str | None
    bytes: int
    seconds: float
    peer: str
    notified: bool | None  # None: no notice asked for
