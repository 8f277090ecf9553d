"""The app's starting settings from command-line flags and environment variables; the sidebar
can change them afterwards.

    streamlit run dashboard/app.py -- --metrics 127.0.0.1:8000 --metrics 10.0.0.2:8000 \\
        --events /tmp/kvlens-events.jsonl --requests /tmp/kvlens-requests.jsonl --refresh 5
    streamlit run dashboard/app.py -- --prometheus http://127.0.0.1:9090

Environment: ``KVLENS_DASHBOARD_METRICS`` (comma-separated endpoints),
``KVLENS_DASHBOARD_PROMETHEUS``, ``KVLENS_DASHBOARD_EVENTS`` (comma-separated logs, else
``KVLENS_EVENT_LOG``, else the server's default), ``KVLENS_DASHBOARD_REQUESTS`` (comma-separated
request logs, else ``KVLENS_REQUEST_LOG``, else none: the request log is off by default),
``KVLENS_DASHBOARD_REFRESH_S``,
``KVLENS_DASHBOARD_MINUTES``. Flags win over the environment.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from telemetry.settings import default_event_log, request_log_path

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


def split_list(raw: str | None) -> tuple[str, ...]:
    return tuple(x.strip() for x in (raw or "").replace("\n", ",").split(",") if x.strip())


def _positive(raw: str | float | None, default: float) -> float:
    try:
        value = float(raw) if raw is not None and str(raw).strip() else default
    except ValueError:
        return default
    return value if value > 0 else default


def parse(argv: Sequence[str], env: Mapping[str, str]) -> Settings:
    p = argparse.ArgumentParser(prog="streamlit run dashboard/app.py --", add_help=False)
    p.add_argument("--metrics", action="append", default=[], help="a vLLM /metrics endpoint (repeatable)")
    p.add_argument("--prometheus", default=None, help="a Prometheus URL (instead of reading /metrics)")
    p.add_argument("--events", action="append", default=[], help="a failed-load event log (repeatable)")
    p.add_argument("--requests", action="append", default=[], help="a per-request log (repeatable)")
    p.add_argument("--refresh", type=float, default=None, help="seconds between refreshes")
    p.add_argument("--minutes", type=float, default=None, help="time range shown, in minutes")
    args, _unknown = p.parse_known_args(list(argv))
    endpoints = tuple(e for raw in args.metrics for e in split_list(raw)) or split_list(
        env.get("KVLENS_DASHBOARD_METRICS")
    )
    prometheus = args.prometheus or env.get("KVLENS_DASHBOARD_PROMETHEUS", "").strip()
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
    )
