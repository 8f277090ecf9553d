"""Builds the KVLens Grafana dashboard from ``grafana.panels`` with Grafana's typed SDK.

    python -m grafana.build           # writes grafana/dashboards/kvlens.json
    python -m grafana.build --check   # exits 1 when the committed JSON is not what this builds

The JSON is what file provisioning loads: every query uses the ``${datasource}`` variable
(no ``${DS_PROMETHEUS}`` import placeholder), a fixed uid, and links to the trace backend
through the ``${traces}`` datasource variable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries, trend
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models import prometheus as prom_model

from dashboard import palette

from .panels import (
    FAILED_LOADS_ANNOTATION,
    PANELS,
    ROWS,
    STAT,
    TABLE,
    TRACES_ALL,
    TREND,
    Panel,
    with_selector,
)

OUT = Path(__file__).resolve().parent / "dashboards" / "kvlens.json"
UID = "kvlens-overview"
PROMETHEUS = model.DataSourceRef(type_val="prometheus", uid="${datasource}")
HEIGHT = 8
STAT_HEIGHT = 4


def trace_search_url(traceql: str) -> str:
    """Grafana Explore on the ``${traces}`` datasource (Tempo) with a TraceQL search, same time range."""
    query = {
        "refId": "A",
        "datasource": {"type": "tempo", "uid": "${traces}"},
        "queryType": "traceql",
        "query": traceql,
    }
    time_range = {"from": "${__from}", "to": "${__to}"}
    panes = {"kvlens": {"datasource": "${traces}", "queries": [query], "range": time_range}}
    encoded = quote(json.dumps(panes, separators=(",", ":")), safe="${}_")
    return f"/explore?schemaVersion=1&orgId=1&panes={encoded}"


def _target(expr: str, legend: str, ref: str, instant: bool, as_table: bool = False) -> prometheus.Dataquery:
    q = prometheus.Dataquery().expr(with_selector(expr)).legend_format(legend or "__auto").ref_id(ref)
    q = q.datasource(PROMETHEUS)
    if as_table:
        q = q.format(prom_model.PromQueryFormat.TABLE)
    return q.instant() if instant else q.range()


def _no_traffic() -> list[model.ValueMapping]:
    return [
        model.SpecialValueMap(
            options=model.DashboardSpecialValueMapOptions(
                match=model.SpecialValueMatch.NULL_AND_NAN,
                result=model.ValueMappingResult(text="No traffic", color="text"),
            )
        )
    ]


def _thresholds(red_above: float | None) -> dash.ThresholdsConfig:
    steps = [model.Threshold(value=None, color="green")]
    if red_above is not None:
        steps.append(model.Threshold(value=red_above + 1e-9, color="red"))
    return dash.ThresholdsConfig().mode(model.ThresholdsMode.ABSOLUTE).steps(steps)


def _reshaped(b: Any, p: Panel) -> Any:
    """Transformations, field overrides and the x axis of trend and table panels."""
    b = b.transformations(
        [model.DataTransformerConfig(id_val=t["id"], options=t["options"]) for t in p.transformations]
    )
    for pattern, props in p.overrides:
        b = b.override_by_regexp(
            pattern, [model.DynamicConfigValue(id_val=k, value=v) for k, v in props.items()]
        )
    if p.x_field:
        b = b.x_field(p.x_field)
        x: dict[str, Any] = {"min": 0.125, "max": 16, "unit": "none", "decimals": 3}
        if p.log2_x:
            x["custom.scaleDistribution"] = {"type": "log", "log": 2}
        b = b.override_by_name(p.x_field, [model.DynamicConfigValue(id_val=k, value=v) for k, v in x.items()])
    return b


# The values a legend template can take whose series have a colour of their own in the palette
# (instances, tenants and reasons have none here: Grafana's classic palette colours them).
TEMPLATE_VALUES: dict[str, tuple[str, ...]] = {
    "tier": tuple(palette.TIERS),
    "source": tuple(palette.ALIASES),
    "operation": palette.OPERATIONS,
    "phase": (*palette.PHASE_LABELS, "ttft"),  # PD: prefill, transfer_wait, decode_first_token, ttft
}


def series_names(legend: str) -> list[str]:
    """Every series name a legend template gives for the label values of ``TEMPLATE_VALUES``;
    none for a template on other labels."""
    names = [legend]
    for label, values in TEMPLATE_VALUES.items():
        token = "{{" + label + "}}"
        if token in legend:
            names = [n.replace(token, v) for n in names for v in values]
    return [n for n in names if n and "{{" not in n]


def _coloured(b: Any, p: Panel) -> Any:
    """A per-series override fixing each known series' colour to the app's (``dashboard.palette``)."""
    names = dict.fromkeys(n for t in p.targets for n in series_names(t.legend))
    for name in names:
        fixed = {"mode": "fixed", "fixedColor": palette.colour(name)}
        b = b.override_by_name(name, [model.DynamicConfigValue(id_val="color", value=fixed)])
    return b


def _panel(p: Panel, panel_id: int) -> cogbuilder.Builder[model.Panel]:
    instant = p.kind in (STAT, TREND, TABLE)
    kinds: dict[str, Any] = {STAT: stat.Panel, TREND: trend.Panel, TABLE: table.Panel}
    b: Any = kinds.get(p.kind, timeseries.Panel)()
    b = b.id(panel_id).title(p.title).description(p.description).unit(p.unit).datasource(PROMETHEUS)
    b = b.span(p.width).height(p.height or (STAT_HEIGHT if p.kind == STAT else HEIGHT))
    for i, t in enumerate(p.targets):
        b = b.with_target(_target(t.expr, t.legend, chr(ord("A") + i), instant, p.kind == TABLE))
    b = b.thresholds(_thresholds(p.alert_above))
    if p.ratio:
        b = b.min(0).max(1).mappings(_no_traffic()).no_value("No traffic")
    if p.kind in (TREND, TABLE):
        b = _reshaped(b, p)
        if p.kind == TREND:
            b = b.line_width(2).show_points(common.VisibilityMode.ALWAYS).point_size(5)
            legend = common_b.VizLegendOptions().show_legend(True).display_mode(common.LegendDisplayMode.LIST)
            b = b.legend(legend)
        else:
            b = b.show_header(True)
        return b
    if p.kind == STAT:
        b = b.graph_mode(common.BigValueGraphMode.NONE).color_mode(common.BigValueColorMode.VALUE)
        b = b.reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]))
    else:
        b = b.fill_opacity(20 if p.stack else 8).line_width(1).show_points(common.VisibilityMode.NEVER)
        legend = common_b.VizLegendOptions().show_legend(True).display_mode(common.LegendDisplayMode.LIST)
        b = b.legend(legend)
        b = b.tooltip(common_b.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI))
        if p.stack:
            b = b.stacking(common_b.StackingConfig().mode(common.StackingMode.NORMAL))
        b = _coloured(b, p)
    if p.traces:
        link = dash.DashboardLink("Traces: " + p.traces).url(trace_search_url(p.traces)).target_blank(True)
        b = b.links([link])
    return b


class _PromAnnotation(model.AnnotationQuery):
    """A Prometheus annotation: the SDK's AnnotationQuery has no title/text format or step."""

    def __init__(self, title: str, text: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.title_format, self.text_format = title, text

    def to_json(self) -> dict[str, object]:
        payload = super().to_json()
        payload.update(
            {"titleFormat": self.title_format, "textFormat": self.text_format, "step": "$__interval"}
        )
        payload["tagKeys"] = "instance"
        return payload


class _Built(cogbuilder.Builder[model.AnnotationQuery]):
    def __init__(self, built: model.AnnotationQuery) -> None:
        self._built = built

    def build(self) -> model.AnnotationQuery:
        return self._built


def _annotations() -> list[cogbuilder.Builder[model.AnnotationQuery]]:
    grafana = (
        dash.AnnotationQuery()
        .name("Annotations & Alerts")
        .datasource(model.DataSourceRef(type_val="grafana", uid="-- Grafana --"))
        .enable(True)
        .hide(True)
        .icon_color("rgba(0, 211, 255, 1)")
        .type("dashboard")
        .target(dash.AnnotationTarget().limit(100).match_any(False).tags([]).type("dashboard"))
    )
    failed = _PromAnnotation(
        "KVLens failed loads",
        FAILED_LOADS_ANNOTATION.legend,
        name="KVLens failed loads",
        datasource=PROMETHEUS,
        enable=True,
        hide=False,
        icon_color="red",
        expr=with_selector(FAILED_LOADS_ANNOTATION.expr),
    )
    return [grafana, _Built(failed)]


def _variables() -> list[cogbuilder.Builder[model.VariableModel]]:
    def label_values(name: str, label: str, selector: str = "") -> dash.QueryVariable:
        return (
            dash.QueryVariable(label)
            .label(label)
            .datasource(PROMETHEUS)
            .query(f"label_values(vllm:kvlens_lookup_requests_total{selector}, {label})")
            .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(model.VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
            .all_value(".*")
            .current(model.VariableOption(selected=True, text="All", value="$__all"))
        )

    return [
        dash.DatasourceVariable("datasource").label("Prometheus").type("prometheus"),
        dash.DatasourceVariable("traces").label("Traces").type("tempo"),
        label_values("model_name", "model_name"),
        label_values("instance", "instance", '{model_name=~"$model_name"}'),
    ]


def build_dashboard() -> dict[str, Any]:
    b = (
        dash.Dashboard("KVLens")
        .uid(UID)
        .description("What the KV cache saves, where it misses, how fast it is, what leaks and what failed.")
        .tags(["kvlens", "vllm", "kv-cache"])
        .editable()
        .tooltip(model.DashboardCursorSync.CROSSHAIR)
        .time("now-1h", "now")
        .refresh("10s")
        .timezone("browser")
        .link(
            dash.DashboardLink("KVLens traces")
            .type(model.DashboardLinkType.LINK)
            .icon("external link")
            .url(trace_search_url(TRACES_ALL))
            .target_blank(True)
        )
        .annotations(_annotations())
        .variables(_variables())
    )
    panel_id = 1
    for row in ROWS:
        b = b.with_row(dash.Row(row).id(panel_id))
        panel_id += 1
        for p in (p for p in PANELS if p.row == row):
            b = b.with_panel(_panel(p, panel_id))
            panel_id += 1
    data = json.loads(JSONEncoder(sort_keys=True).encode(b.build()))
    data["id"] = None
    data["schemaVersion"] = 39
    return data


def render() -> str:
    return json.dumps(build_dashboard(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="compare with the committed JSON instead of writing"
    )
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is out of date: run python -m grafana.build", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
