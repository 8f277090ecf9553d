"""Remote-tier round trips (the connector's ``RemoteCall`` values) as metrics and child spans."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from . import tracing as tr
from .metrics import StatsBuffer, wire_key

if TYPE_CHECKING:
    from connector.engine.outcomes import RemoteCall

_COMMAND = {"exists": "EXISTS", "get": "GET", "put": "SET", "delete": "UNLINK"}


def count(buffer: StatsBuffer, calls: Iterable[RemoteCall]) -> None:
    for call in calls:
        buffer.observe(wire_key("remote_seconds", call.operation), max(call.end_ns - call.start_ns, 0) / 1e9)
        buffer.inc(wire_key("remote_bytes", call.operation), call.nbytes)
        if call.error is not None:
            buffer.inc(wire_key("remote_errors", call.operation, call.error))


def child_spans(calls: Iterable[RemoteCall]) -> list[tr.Child]:
    out = []
    for call in calls:
        attrs: dict[str, Any] = {
            "db.system.name": "redis",
            "db.operation.name": _COMMAND.get(call.operation, call.operation.upper()),
            "db.operation.batch.size": call.keys,
            tr.A_BYTES: call.nbytes,
        }
        out.append(tr.Child(tr.REMOTE_CALL, call.start_ns, call.end_ns, attrs, call.error))
    return out
