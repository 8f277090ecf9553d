"""What a dashboard panel is (``Panel``, ``Target``) and the PromQL helpers that write its
queries, shared by ``grafana.panels`` and ``grafana.insight_panels``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TIMESERIES, STAT, TREND, TABLE = "timeseries", "stat", "trend", "table"

TOKENS_PER_S = "suffix: tok/s"
TOKENS = "suffix: tok"


@dataclass(frozen=True, slots=True)
class Target:
    expr: str
    legend: str = ""


@dataclass(frozen=True, slots=True)
class Panel:
    row: str
    title: str
    unit: str  # a Grafana unit id ("percentunit", "s", "Bps", ...) or "suffix: ..."
    targets: tuple[Target, ...]
    description: str
    kind: str = TIMESERIES
    width: int = 8
    ratio: bool = False  # a 0..1 ratio: axis 0-1, "No traffic" when there is no denominator
    stack: bool = False
    height: int | None = None  # grid rows; default 4 for stats, 8 for time series
    alert_above: float | None = None  # stat turns red above this value
    traces: str | None = None  # TraceQL the panel links to
    # Trend and table panels: instant queries in table format, reshaped by Grafana transformations.
    transformations: tuple[dict[str, Any], ...] = ()
    x_field: str | None = None  # trend: the numeric field on the x axis
    log2_x: bool = False  # trend: a log2 x axis
    overrides: tuple[tuple[str, dict[str, Any]], ...] = field(default=())  # (field name regex, properties)
    needs_remote: bool = False  # data only where a remote tier (Redis) is configured
    needs_pd: bool = False  # data only where PD engines (and kvlens pd-proxy) run
    needs_blend: bool = False  # data only where blending is on (enable_blending)


def rate_sum(name: str, by: str = "", matchers: str = "", window: str = "$__rate_interval") -> str:
    group = f" by ({by})" if by else ""
    sel = f"{{{matchers}}}" if matchers else ""
    return f"sum{group} (rate({name}{sel}[{window}]))"


def ratio(num: str, den: str) -> str:
    return f"{num}\n/\n({den} > 0)"


def quantile(q: float, bucket: str, by: str = "", matchers: str = "") -> str:
    labels = ", ".join(x for x in ("le", by) if x)
    sel = f"{{{matchers}}}" if matchers else ""
    return f"histogram_quantile({q}, sum by ({labels}) (rate({bucket}{sel}[$__rate_interval])))"


def increase_sum(name: str, matchers: str = "", by: str = "") -> str:
    group = f" by ({by})" if by else ""
    sel = f"{{{matchers}}}" if matchers else ""
    return f"sum{group} (increase({name}{sel}[$__range]))"
