"""Words and numbers the app shows: status messages and human-readable figures."""

from __future__ import annotations

import math

from . import failures, logfiles, sources

ERROR, WARNING, INFO = "error", "warning", "info"
UNKNOWN = "–"  # an unknown number (a ratio of nothing looked up, a cost not measured yet)


def status_message(status: sources.Status) -> tuple[str, str] | None:
    """(level, text) for a source that is not OK, else None."""
    where = status.source
    detail = f" ({status.detail})" if status.detail else ""
    if status.state == sources.UNREACHABLE:
        return ERROR, f"Endpoint unreachable: {where}{detail}. Is vLLM running there?"
    if status.state == sources.SLOW:
        return WARNING, (
            f"Endpoint slow: {where} did not answer in time{detail}; the charts show what it "
            "answered before, and it is read again at the next refresh."
        )
    if status.state == sources.NO_KVLENS:
        return WARNING, (
            f"No KVLens metrics at this endpoint: {where}. vLLM answers, but without vllm:kvlens_* series: "
            "start it with --kv-transfer-config for KVLensConnector (and KVLENS_METRICS not 0)."
        )
    if status.state == sources.QUERY_FAILED:
        return ERROR, f"Prometheus query failed: {where}{detail}"
    if status.state == sources.BAD_RESPONSE:
        return ERROR, f"Not a Prometheus /metrics page: {where}{detail}"
    if status.state == sources.NO_DATA:
        return INFO, f"No data yet from {where}{detail}"
    return None


def log_message(status: failures.LogStatus) -> str | None:
    if status.state == failures.MISSING:
        return f"No events yet: {status.path} does not exist (it is created at the first failed load)."
    if status.state == failures.EMPTY:
        return f"No events yet: {status.path} holds no failed load."
    return None


EXPOSED = (
    "This app is listening on every network interface (Streamlit's default), so it shows "
    "nothing. Start it from the repository root, whose .streamlit/config.toml binds it to "
    "127.0.0.1, or choose on purpose: --server.address 127.0.0.1 (this machine only) or "
    "--server.address 0.0.0.0 (every interface)."
)

REQUEST_LOG_OFF = (
    "Request log not enabled: set KVLENS_REQUEST_LOG=/path/to/kvlens-requests.jsonl for vLLM "
    "(KVLENS_REQUEST_LOG_SAMPLE=0.1 keeps one request in ten), then start the dashboard with the "
    "same variable or --requests PATH."
)


def request_log_message(status: logfiles.LogStatus) -> str | None:
    if status.state == logfiles.MISSING:
        return (
            f"No requests logged yet: {status.path} does not exist (it is created when the first "
            "sampled request finishes)."
        )
    if status.state == logfiles.EMPTY:
        return f"No requests logged yet: {status.path} holds no finished request."
    return None


def skipped_message(status: logfiles.LogStatus) -> str | None:
    if not status.skipped:
        return None
    lines = "line" if status.skipped == 1 else "lines"
    return f"Skipped {status.skipped} unreadable {lines} in {status.path} (torn or not a KVLens record)."


HELD_HELP = (
    "Share of looked-up prompt tokens KVLens held in a tier at lookup, or (on a PD decoder) "
    "received from a prefiller, since the servers started."
)
PD_SOURCE = (
    "Received from a prefiller (PD): on a PD decoder, prompt tokens whose KV a prefiller computed "
    "and sent; the decoder loaded them from its receive buffer instead of computing them "
    "(vllm:kvlens_pd_loaded_tokens_total; vLLM counts them under source p2p). They count as "
    "supplied by KVLens on the decoder and as computed on the prefiller."
)


def loaded_help(tiers: float, received: float) -> str:
    """The help of "Prompt tokens loaded by KVLens" where PD runs: what it is made of."""
    return (
        f"{number(tiers)} loaded from KVLens's tiers and {number(received)} received from a "
        f"prefiller (PD), since the servers started. {PD_SOURCE}"
    )


def overview_caption(window_s: float, with_pd: bool) -> str:
    caption = f"Rates over {window_s:.0f} s windows. KVLens per tier: tokens it loaded into vLLM."
    return f"{caption} {PD_SOURCE}" if with_pd else caption


def number(value: float | None, unit: str = "") -> str:
    """1234567 -> '1.23M', with an optional unit; '–' when unknown."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return UNKNOWN
    for size, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            return f"{value / size:.3g}{suffix}{' ' + unit if unit else ''}"
    text = f"{value:.3g}" if not float(value).is_integer() else f"{int(value)}"
    return f"{text}{' ' + unit if unit else ''}"


def seconds(value: float | None) -> str:
    if value is None or math.isnan(value):
        return UNKNOWN
    if value < 1:
        return f"{value * 1000:.3g} ms"
    if value < 120:
        return f"{value:.3g} s"
    if value < 7200:
        return f"{value / 60:.3g} min"
    return f"{value / 3600:.3g} h"


def percent(value: float | None) -> str:
    return UNKNOWN if value is None or math.isnan(value) else f"{value:.1%}"
