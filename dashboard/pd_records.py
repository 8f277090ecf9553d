"""The PD proxy's per-request records (``GET /kvlens/pd/requests?limit=N`` on ``kvlens pd-proxy``):
read, checked and laid out as a frame, and one request's time to first token split three ways.
No Streamlit.

A record (the PD design's names)::

    {"req_id", "prefiller", "decoder", "prompt_tokens", "outcome", "ttft_ms", "prefill_ms",
     "transfer_wait_ms", "decode_first_token_ms", "decoder_pd": {...kvlens.pd...} | null, "trace_id"}

Anything missing or not a number reads as unknown (NaN, shown "–"), never as 0.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import pandas as pd

from . import palette
from .sources import BAD_RESPONSE, NO_DATA, OK, UNREACHABLE, Status, failure, fetch_text
from .urls import http_url

PATH = "/kvlens/pd/requests"
DEFAULT_LIMIT = 200
MAX_BYTES = 8 << 20  # a page of records larger than this is refused, not parsed

# (record field, column) of the proxy's own numbers, then those of the decoder's kvlens.pd
PHASE_FIELDS = (
    ("prefill_ms", palette.PREFILL),
    ("transfer_wait_ms", palette.TRANSFER_WAIT),
    ("decode_first_token_ms", palette.DECODE_FIRST_TOKEN),
)
TEXT_FIELDS = ("req_id", "prefiller", "decoder", "outcome", "trace_id")
DECODER_FIELDS = (
    ("outcome", "decoder outcome"),
    ("reason", "decoder reason"),
    ("tokens", "tokens received"),
    ("bytes", "bytes received"),
    ("transfer_ms", "transfer ms"),
    ("notify_wait_ms", "notify wait ms"),
    ("buffer_ms", "buffer ms"),
)
COLUMNS = (
    "req_id",
    "prefiller",
    "decoder",
    "prompt_tokens",
    "outcome",
    "ttft_ms",
    *(column for _, column in PHASE_FIELDS),
    *(column for _, column in DECODER_FIELDS),
    "trace_id",
)


def requests_url(proxy: str, limit: int = DEFAULT_LIMIT) -> str:
    """``host:port`` or the proxy's URL -> the URL of its newest ``limit`` records."""
    base = http_url(proxy)
    root = base if urlsplit(base).path in ("", "/") else base[: -len(urlsplit(base).path)]
    return f"{root.rstrip('/')}{PATH}?limit={int(limit)}"


def metrics_url(proxy: str) -> str:
    base = http_url(proxy)
    root = base if urlsplit(base).path in ("", "/") else base[: -len(urlsplit(base).path)]
    return root.rstrip("/") + "/metrics"


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return math.nan
    return float(value) if math.isfinite(value) else math.nan


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def row(record: dict[str, Any]) -> dict[str, Any]:
    """One record as a row of ``COLUMNS``."""
    out: dict[str, Any] = {f: _text(record.get(f)) for f in TEXT_FIELDS}
    out["prompt_tokens"] = _number(record.get("prompt_tokens"))
    out["ttft_ms"] = _number(record.get("ttft_ms"))
    for field, column in PHASE_FIELDS:
        out[column] = _number(record.get(field))
    pd_side = record.get("decoder_pd")
    pd_side = pd_side if isinstance(pd_side, dict) else {}
    for field, column in DECODER_FIELDS:
        value = pd_side.get(field)
        out[column] = _text(value) if field in ("outcome", "reason") else _number(value)
    return out


def frame(records: list[Any]) -> pd.DataFrame:
    """The records as a frame, in the proxy's order (newest first); entries that are not objects
    or have no ``req_id`` are left out."""
    rows = [row(r) for r in records if isinstance(r, dict) and isinstance(r.get("req_id"), str)]
    return pd.DataFrame(rows, columns=list(COLUMNS))


def parse(body: str) -> list[Any]:
    """The list of records in a response body: a JSON list, or an object holding one under
    ``requests`` or ``records``. Anything else raises ``ValueError``."""
    data = json.loads(body)
    if isinstance(data, dict):
        data = data.get("requests", data.get("records"))
    if not isinstance(data, list):
        raise ValueError("not a list of records")
    return data


def read(
    proxy: str, limit: int = DEFAULT_LIMIT, fetch: Callable[[str], str] = fetch_text
) -> tuple[pd.DataFrame, Status]:
    """The proxy's newest records, never raising: the frame and what went wrong, if anything
    (never a quote of what the proxy sent)."""
    try:
        url = requests_url(proxy, limit)
        body = fetch(url)
    except Exception as e:  # noqa: BLE001 - any failure to read is "unreachable"
        return frame([]), Status(proxy, UNREACHABLE, failure(e))
    if len(body) > MAX_BYTES:
        return frame([]), Status(url, BAD_RESPONSE, f"more than {MAX_BYTES >> 20} MiB of records")
    try:
        records = parse(body)
    except (ValueError, TypeError) as e:
        return frame([]), Status(url, BAD_RESPONSE, f"not a JSON list of records ({type(e).__name__})")
    out = frame(records)
    return out, Status(url, OK) if not out.empty else Status(url, NO_DATA, "no PD request recorded yet")


def split(request: pd.Series) -> pd.Series:
    """One request's time to first token in its parts (ms; NaN: unknown): its three phases and
    the proxy's own time between them (the rest of its time to first token)."""
    parts = pd.Series({column: request.get(column, math.nan) for _, column in PHASE_FIELDS}, dtype=float)
    parts[palette.PROXY] = float(request.get("ttft_ms", math.nan)) - parts.sum(min_count=len(parts))
    return parts.rename("ms")


def explain(request: pd.Series) -> str:
    """One line saying where a request's time to first token went."""
    from .text import UNKNOWN

    def ms(value: Any) -> str:
        return (
            UNKNOWN
            if value is None or (isinstance(value, float) and math.isnan(value))
            else f"{value:,.1f} ms"
        )

    parts = "; ".join(f"{name} {ms(v)}" for name, v in split(request).items())
    pd_outcome = request.get("decoder outcome")
    decoder = f"; decoder {pd_outcome}" if isinstance(pd_outcome, str) else ""
    reason = request.get("decoder reason")
    decoder += f" ({reason})" if isinstance(reason, str) and reason else ""
    prefiller, decoder_at = request.get("prefiller") or UNKNOWN, request.get("decoder") or UNKNOWN
    return (
        f"{request['req_id']}: time to first token {ms(request.get('ttft_ms'))} = {parts}"
        f"{decoder} (prefiller {prefiller}, decoder {decoder_at})"
    )
