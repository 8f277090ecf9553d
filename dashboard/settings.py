"""The app's starting settings from command-line flags and environment variables.

    streamlit run dashboard/app.py -- --metrics 127.0.0.1:8000 --metrics 10.0.0.2:8000 \\
        --events /tmp/kvlens-events.jsonl --requests /tmp/kvlens-requests.jsonl --refresh 5
    streamlit run dashboard/app.py -- --prometheus http://127.0.0.1:9090

What the app reads (the /metrics endpoints, the Prometheus URL, the event and request logs) is
fixed here, when it starts: whoever opens the page cannot point the server at other files or
URLs. ``--allow-source-edits`` lets the page edit the endpoint and Prometheus URLs (http and
https only); log paths are never editable. Only http(s) URLs are accepted anywhere.

Environment: ``KVLENS_DASHBOARD_METRICS`` (comma-separated endpoints),
``KVLENS_DASHBOARD_PROMETHEUS``, ``KVLENS_DASHBOARD_EVENTS`` (comma-separated logs, else
``KVLENS_EVENT_LOG``, else the server's default), ``KVLENS_DASHBOARD_REQUESTS`` (comma-separated
request logs, else ``KVLENS_REQUEST_LOG``, else none: the request log is off by default),
``KVLENS_DASHBOARD_REFRESH_S``,
``KVLENS_DASHBOARD_MINUTES``, ``KVLENS_DASHBOARD_PD_PROXY`` (a ``kvlens pd-proxy``, host:port: the
PD tab reads its /metrics, or Prometheus's copy of them, and its request records). Flags win over
the environment.

Streamlit listens on every interface unless told otherwise; the repository's
``.streamlit/config.toml`` binds it to 127.0.0.1 when started from the repository root, and the
app refuses to show anything when it finds itself on every interface by default.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from telemetry.settings import default_event_log, request_log_path

from .urls import NotHttpURL, http_url

DEFAULT_ENDPOINT = "127.0.0.1:8000"  # the demo server (scripts/demo.sh)
METRICS, PROMETHEUS = "metrics", "prometheus"


@dataclass(frozen=True, slots=True)
class Settings:
    source: str  # METRICS (read /metrics directly) or PROMETHEUS
    endpoints: tuple[str, ...]
    prometheus: str
    events: tuple[str, ...]
    refresh_s: float
    minutes: float  # time range shown (the history kept for direct reads)
    requests: tuple[str, ...] = ()  # per-request logs; none = the request log is not enabled
    allow_source_edits: bool = False  # the page may edit endpoint and Prometheus URLs (http(s))
    pd_proxy: str = ""  # a `kvlens pd-proxy` (host:port or URL): its /metrics and request records


def split_list(raw: str | None) -> tuple[str, ...]:
    return tuple(x.strip() for x in (raw or "").replace("\n", ",").split(",") if x.strip())


def checked_endpoints(entries: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the http(s) endpoints, the entries refused) of a list typed in the page."""
    kept, refused = [], []
    for entry in entries:
        try:
            http_url(entry)
        except NotHttpURL:
            refused.append(entry)
        else:
            kept.append(entry)
    return tuple(kept), tuple(refused)


def _checked(urls: Sequence[str], where: str) -> None:
    for url in urls:
        try:
            http_url(url)
        except NotHttpURL as e:
            raise NotHttpURL(f"{where} {e}") from None


def listens_everywhere_by_default(address: str | None, where_defined: str) -> bool:
    """True when Streamlit's server.address was left unset: it then listens on every interface
    (``where_defined`` is Streamlit's ``config.get_where_defined``: "<default>" when unset)."""
    return not address and where_defined == "<default>"


def _positive(raw: str | float | None, default: float) -> float:
    try:
        value = float(raw) if raw is not None and str(raw).strip() else default
    except ValueError:
        return default
    return value if value > 0 else default


# What http_url and metrics_url (urls.py) accept, said once for the flag and the docs.
METRICS_HELP = (
    "a vLLM server: host, host:port or host:port/path (read over http://), or an http:// or https:// "
    "URL; without a path its /metrics is read, with one that path; several comma-separated, or "
    "repeat the flag (any other scheme stops the app)"
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="streamlit run dashboard/app.py --", add_help=False)
    p.add_argument("--metrics", action="append", default=[], help=METRICS_HELP)
    p.add_argument("--prometheus", default=None, help="a Prometheus URL (instead of reading /metrics)")
    p.add_argument("--events", action="append", default=[], help="a failed-load event log (repeatable)")
    p.add_argument("--requests", action="append", default=[], help="a per-request log (repeatable)")
    p.add_argument("--refresh", type=float, default=None, help="seconds between refreshes")
    p.add_argument("--minutes", type=float, default=None, help="time range shown, in minutes")
    p.add_argument("--pd-proxy", default=None, help="a kvlens pd-proxy (host:port): PD phases and requests")
    p.add_argument(
        "--allow-source-edits",
        action="store_true",
        help="let the page edit the endpoint and Prometheus URLs (http and https only)",
    )
    return p


def parse(argv: Sequence[str], env: Mapping[str, str]) -> Settings:
    args, _unknown = parser().parse_known_args(list(argv))
    endpoints = tuple(e for raw in args.metrics for e in split_list(raw))
    _checked(endpoints, "--metrics")
    if not endpoints:
        endpoints = split_list(env.get("KVLENS_DASHBOARD_METRICS"))
        _checked(endpoints, "KVLENS_DASHBOARD_METRICS")
    prometheus = (args.prometheus or "").strip()
    _checked([prometheus] if prometheus else [], "--prometheus")
    if not prometheus:
        prometheus = env.get("KVLENS_DASHBOARD_PROMETHEUS", "").strip()
        _checked([prometheus] if prometheus else [], "KVLENS_DASHBOARD_PROMETHEUS")
    pd_proxy = (args.pd_proxy or "").strip()
    _checked([pd_proxy] if pd_proxy else [], "--pd-proxy")
    if not pd_proxy:
        pd_proxy = env.get("KVLENS_DASHBOARD_PD_PROXY", "").strip()
        _checked([pd_proxy] if pd_proxy else [], "KVLENS_DASHBOARD_PD_PROXY")
    events = tuple(e for raw in args.events for e in split_list(raw)) or split_list(
        env.get("KVLENS_DASHBOARD_EVENTS") or env.get("KVLENS_EVENT_LOG")
    )
    requests = tuple(r for raw in args.requests for r in split_list(raw)) or split_list(
        env.get("KVLENS_DASHBOARD_REQUESTS") or request_log_path(env)
    )
    return Settings(
        source=PROMETHEUS if prometheus and not endpoints else METRICS,
        endpoints=endpoints or (DEFAULT_ENDPOINT,),
        prometheus=prometheus,
        events=events or (default_event_log(),),
        refresh_s=_positive(
            args.refresh if args.refresh is not None else env.get("KVLENS_DASHBOARD_REFRESH_S"), 5.0
        ),
        minutes=_positive(
            args.minutes if args.minutes is not None else env.get("KVLENS_DASHBOARD_MINUTES"), 30.0
        ),
        requests=requests,
        allow_source_edits=args.allow_source_edits,
        pd_proxy=pd_proxy,
    )
