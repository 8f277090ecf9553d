"""The per-request log: one JSON line per finished request saying where its prompt tokens came
from and, when KVLens did not supply them, why ("why did this request miss?").

It is written by ``events.EventLog`` (one ``O_APPEND`` write per line, rotation, a private
0700/0600 file, no symbolic links), so it reads like the failed-load log. A record holds counts,
reasons and timings only: never prompt text or token ids.

Sampling is decided from a hash of the request id, not a random draw, so every process and
every rerun keeps the same ids. Off is ``RequestLog.from_settings(...) is None``: the caller keeps
``None`` and pays one check per request.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import math
import time
from collections.abc import Iterable, Mapping
from enum import Enum
from typing import TYPE_CHECKING, Any

from .events import EventLog

if TYPE_CHECKING:
    from .settings import TelemetrySettings

REQUEST = "request"

FIELDS = (
    "time",
    "ts",
    "event",
    "request_id",
    "engine",
    "model",
    "prompt_tokens",
    "vllm_cached_tokens",
    "kvlens_tokens",
    "kvlens_tokens_by_tier",
    "computed_tokens",
    "miss_reason",
    "miss_detail",
    "lookup_ms",
    "load_ms",
    "stored_chunks",
    "failed",
    "failure_reasons",
    "trace_id",
    "blend",
)

_SCALE = float(2**64)


def sampled(request_id: str, rate: float) -> bool:
    """Whether ``request_id`` is in the sampled share ``rate`` (0 none, 1 all): the first 8 bytes
    of its BLAKE2b digest, read as a fraction of 2**64, fall below ``rate``."""
    if rate >= 1.0:
        return True
    if not rate > 0.0:
        return False
    digest = hashlib.blake2b(request_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") < rate * _SCALE


def request_record(
    *,
    request_id: str,
    engine: str,
    model: str,
    prompt_tokens: int,
    vllm_cached_tokens: int,
    kvlens_tokens_by_tier: Mapping[str, int],
    lookup_ms: float,
    miss_reason: str | Enum | None = None,
    miss_detail: Mapping[str, Any] | None = None,
    load_ms: float | None = None,
    stored_chunks: int = 0,
    failed: bool = False,
    failure_reasons: Iterable[str] = (),
    trace_id: str | None = None,
    blend: Mapping[str, Any] | None = None,
    now: float | None = None,
) -> dict[str, Any]:
    """One finished request as the log writes it (``FIELDS``, in that order).

    ``kvlens_tokens_by_tier`` are the prompt tokens KVLens supplied, per tier it read them from;
    ``kvlens_tokens`` is their sum, and ``computed_tokens`` what is left for vLLM to compute.
    ``miss_reason`` takes a ``MissReason`` or its value; ``blend``: a blended request's
    ``kvlens.blend`` (its response's), None otherwise; ``now`` is for tests."""
    now = time.time() if now is None else now
    by_tier = {str(tier): int(n) for tier, n in kvlens_tokens_by_tier.items() if n}
    kvlens = sum(by_tier.values())
    return {
        "time": dt.datetime.fromtimestamp(now, dt.timezone.utc).isoformat(timespec="milliseconds"),
        "ts": round(now, 6),
        "event": REQUEST,
        "request_id": request_id,
        "engine": engine,
        "model": model,
        "prompt_tokens": int(prompt_tokens),
        "vllm_cached_tokens": int(vllm_cached_tokens),
        "kvlens_tokens": kvlens,
        "kvlens_tokens_by_tier": by_tier,
        "computed_tokens": max(int(prompt_tokens) - int(vllm_cached_tokens) - kvlens, 0),
        "miss_reason": miss_reason.value if isinstance(miss_reason, Enum) else miss_reason,
        "miss_detail": dict(miss_detail) if miss_detail is not None else None,
        "lookup_ms": _ms(lookup_ms),
        "load_ms": _ms(load_ms),
        "stored_chunks": int(stored_chunks),
        "failed": bool(failed),
        "failure_reasons": [str(r) for r in failure_reasons],
        "trace_id": trace_id,
        "blend": dict(blend) if blend is not None else None,
    }


def _ms(value: float | None) -> float | None:
    if value is None or math.isnan(value):
        return None
    return round(float(value), 3)


class RequestLog:
    """Appends sampled request records; never raises into the engine (see ``EventLog``)."""

    def __init__(
        self, path: str, sample: float = 1.0, max_bytes: int = 10 * 1024 * 1024, backups: int = 3
    ) -> None:
        if not 0.0 <= sample <= 1.0:
            raise ValueError(f"request log sample rate must be from 0 to 1, got {sample!r}")
        self.sample = sample
        self._log = EventLog(path, max_bytes, backups, name="request log")

    @classmethod
    def from_settings(cls, settings: TelemetrySettings) -> RequestLog | None:
        """The log ``KVLENS_REQUEST_LOG`` asks for, or None when it is off. It shares the event
        log's size limits (``KVLENS_EVENT_LOG_MAX_BYTES`` / ``_BACKUPS``)."""
        if not settings.request_log:
            return None
        return cls(
            settings.request_log,
            settings.request_log_sample,
            settings.event_log_max_bytes,
            settings.event_log_backups,
        )

    @property
    def path(self) -> str:
        return self._log.path

    def wants(self, request_id: str) -> bool:
        """Whether this request is sampled: ask before building its record."""
        return sampled(request_id, self.sample)

    def append(self, record: Mapping[str, Any]) -> bool:
        """Write ``record`` if its request is sampled; True when a line was written."""
        if not self.wants(str(record.get("request_id", ""))):
            return False
        return self._log.append(dict(record))
