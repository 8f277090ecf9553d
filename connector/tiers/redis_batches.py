"""What one batch of the remote tier sends to one node, and what comes back.

GET and SET go through ``redis_wire`` (values read into reused buffers, payloads sent uncopied);
other commands, and GET and SET on connections ``redis_wire`` does not read (RESP3, or a redis-py
that keeps its socket elsewhere), through one redis-py pipeline. Either way a GET batch answers
with checked payloads, so a caller never sees a record.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis import Redis

from . import codec, redis_wire
from .base import ChunkCorrupt
from .read_buffers import ReadBuffers
from .record_trust import OPEN, RecordTrust

logger = logging.getLogger("vllm.kvlens")

# Sends one node the commands of some of a batch's keys (their indices); their replies, in order.
Exchange = Callable[[Redis, list[int]], list[Any]]


class NodeBatches:
    """Builds the exchanges of one tier's batches. Thread-safe."""

    def __init__(
        self, layout: str, ttl_s: int | None, read_buffer_bytes: int, trust: RecordTrust = OPEN
    ) -> None:
        self.layout = layout
        self.ttl_s = ttl_s
        self.trust = trust
        self.buffers = ReadBuffers(read_buffer_bytes)
        self._wire = True  # GET and SET through redis_wire while this redis-py allows it

    def gets(self, names: Sequence[str], keys: list[str]) -> Exchange:
        """Replies: a payload (a checked record), ChunkCorrupt, None (no key) or an error reply."""

        def send(client: Redis, indices: list[int]) -> list[Any]:
            if self._direct(client):
                try:
                    return redis_wire.get_many(
                        client,
                        [keys[i].encode() for i in indices],
                        self.buffers,
                        lambda j: _Check(names[indices[j]], self.layout, self.trust),
                        self.trust.max_record_bytes,
                    )
                except redis_wire.NoSocket as e:
                    self._no_socket(e)
            replies = pipeline(client, [("GET", keys[i]) for i in indices])
            return [
                self.payload(names[i], r) if isinstance(r, bytes) else r
                for i, r in zip(indices, replies, strict=True)
            ]

        return send

    def sets(
        self, keys: list[str], header_of: Callable[[int], bytes], payloads: list[memoryview]
    ) -> Exchange:
        """Replies: True (stored) or an error reply. ``header_of(i)``: item i's record header,
        made as the item is sent (its checksum overlaps the server reading the item before)."""

        def send(client: Redis, indices: list[int]) -> list[Any]:
            if self._direct(client):
                frames = (
                    redis_wire.set_frame(keys[i].encode(), header_of(i), payloads[i], self.ttl_s)
                    for i in indices
                )
                try:
                    return redis_wire.set_many(client, frames)
                except redis_wire.NoSocket as e:
                    self._no_socket(e)
            expiry = () if self.ttl_s is None else ("EX", self.ttl_s)
            return pipeline(
                client, [("SET", keys[i], record(header_of(i), payloads[i]), *expiry) for i in indices]
            )

        return send

    def payload(self, name: str, value: bytes | memoryview) -> memoryview | ChunkCorrupt:
        try:
            return codec.decode(memoryview(value), name, self.layout, self.trust)
        except ChunkCorrupt as e:
            return e

    def close(self) -> None:
        self.buffers.clear()

    def _direct(self, client: Redis) -> bool:
        return self._wire and redis_wire.fast_path(client)

    def _no_socket(self, error: redis_wire.NoSocket) -> None:
        if self._wire:
            self._wire = False
            logger.warning(
                "KVLens: %s connections (redis-py %s) have no socket to read values from; "
                "the remote tier reads and writes through redis-py's pipelines (slower)",
                error,
                redis.__version__,
            )


class _Check(codec.RecordCheck):
    """A record checked as it arrives: its payload, or the ChunkCorrupt saying why not."""

    __slots__ = ()

    def done(self, value: memoryview) -> memoryview | ChunkCorrupt:
        try:
            return self.payload(value)
        except ChunkCorrupt as e:
            return e


def commands(command: str, keys: list[str]) -> Exchange:
    """``command key`` for each key, in one redis-py pipeline."""
    return lambda client, indices: pipeline(client, [(command, keys[i]) for i in indices])


def pipeline(client: Redis, commands: list[tuple[Any, ...]]) -> list[Any]:
    pipe = client.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    return pipe.execute(raise_on_error=False)


def record(header: bytes, payload: memoryview) -> memoryview:
    """One value of header and payload, for a pipeline (one copy of the payload)."""
    value = bytearray(header)
    value += payload
    return memoryview(value)
