"""The reference pages say what the code does: every setting, environment variable, metric and
reason the code knows is documented, and everything the docs name exists with that default,
suffix and label."""

from __future__ import annotations

import ast
import re

import pytest
import yaml

from connector.config.loading import ExtraConfig, KVLensConfig
from connector.engine.outcomes import FailureReason, MissReason, SaveSkipReason
from telemetry.metrics import COUNTER, GAUGE, HISTOGRAM, METRICS

from . import markdown as md

CONFIGURATION = md.DOCS / "configuration.md"
OBSERVABILITY = md.DOCS / "observability.md"
FAILURES = md.DOCS / "failures-and-guarantees.md"
DASHBOARDS = md.DOCS / "dashboards.md"
# Labels every series has, or Prometheus adds.
COMMON_LABELS = {"model_name", "engine", "instance", "job"}
SUFFIXES = {COUNTER: ("_total",), GAUGE: ("",), HISTOGRAM: ("", "_bucket", "_sum", "_count")}


def all_text() -> str:
    return "\n".join(p.read_text() for p in md.pages())


def table(path, heading: str) -> list[list[str]]:
    """Rows of the first table under ``## heading`` (or ``###``), header and rule dropped."""
    lines = path.read_text().split(f"# {heading}\n", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = [line for line in lines[start:]]
    rows = rows[: next((i for i, line in enumerate(rows) if not line.startswith("|")), len(rows))]
    return [[c.strip() for c in row.strip("|").split(" | ")] for row in rows[2:]]


def settings_rows() -> list[tuple[str, str]]:
    """(name, default) per documented setting: `a` / `b` rows give one pair per name."""
    out = []
    for key_cell, default_cell, _ in table(CONFIGURATION, "Settings"):
        names = re.findall(r"`([\w.]+)`", key_cell.split("(")[0])
        defaults = [d.strip() for d in default_cell.split(" / ")]
        out += zip(names, defaults if len(defaults) == len(names) else defaults[:1] * len(names), strict=True)
    return out


def field_of(name: str):
    section, _, key = name.rpartition(".")
    model = ExtraConfig if section == "extra_config" else KVLensConfig
    return model.model_fields.get(key)


def test_every_documented_setting_exists():
    unknown = [name for name, _ in settings_rows() if field_of(name) is None]
    assert not unknown


def test_every_setting_is_documented():
    documented = {name for name, _ in settings_rows()}
    fields = {k for k in KVLensConfig.model_fields if k != "extra_config"}
    fields |= {f"extra_config.{k}" for k in ExtraConfig.model_fields}
    assert fields <= documented


@pytest.mark.parametrize("name,shown", settings_rows())
def test_documented_defaults_are_the_defaults(name, shown):
    default = field_of(name).default
    words = {"true": True, "false": False, "none": None}
    if shown in words:
        assert default is words[shown]
    elif shown == "empty":
        assert default is not None and len(default) == 0
    elif re.fullmatch(r"[\d.]+", shown):
        assert float(shown) == default
    elif shown.startswith("`"):
        assert shown.strip("`") == default
    else:  # "512 MiB"
        number, unit = shown.split()
        assert float(number) * {"MiB": 1024**2, "GiB": 1024**3}[unit] == default


def test_environment_variables_the_code_reads_are_documented():
    code = "\n".join(
        p.read_text() for d in ("connector", "telemetry", "dashboard") for p in (md.REPO / d).rglob("*.py")
    )
    read = set(re.findall(r"\"((?:KVLENS|LMCACHE)_[A-Z][A-Z0-9_]*)\"", code))
    assert read, "the code reads KVLENS_* variables"
    documented = set(re.findall(r"\b(?:KVLENS|LMCACHE)_[A-Z][A-Z0-9_]*\b", all_text()))
    assert sorted(read - documented) == []


def mentions() -> list[tuple[str, str, str]]:
    """(name as written, metric key, label names) for each vllm:kvlens_* in the docs."""
    out = []
    for m in re.finditer(r"vllm:kvlens_(\w+)(\{[^}]*\})?", all_text()):
        labels = re.findall(r"(\w+)\s*(?:=|!=|=~|,|$)", (m.group(2) or "{}")[1:-1].strip())
        out.append((m.group(0), m.group(1), ",".join(labels)))
    return out


def split_suffix(written: str) -> tuple[str, str]:
    for suffix in ("_total", "_bucket", "_sum", "_count"):
        if written.endswith(suffix) and written[: -len(suffix)] in METRICS:
            return written[: -len(suffix)], suffix
    return written, ""


def test_documented_metrics_exist_with_their_suffix_and_labels():
    wrong = []
    for written, key, labels in mentions():
        base, suffix = split_suffix(key)
        metric = METRICS.get(base)
        if metric is None or suffix not in SUFFIXES[metric.kind]:
            wrong.append(written)
            continue
        allowed = COMMON_LABELS | set(metric.labels) | ({"le"} if suffix == "_bucket" else set())
        if not set(filter(None, labels.split(","))) <= allowed:
            wrong.append(written)
    assert not wrong


def test_every_metric_is_documented():
    text = OBSERVABILITY.read_text()
    assert sorted(m.name for m in METRICS.values() if m.name not in text) == []


def test_miss_reason_table_is_the_closed_list():
    rows = table(OBSERVABILITY, "Why did this request miss?")
    assert {row[0].strip("`") for row in rows} == {r.value for r in MissReason}


def test_every_failure_and_save_skip_reason_is_documented():
    failures, observability = FAILURES.read_text(), OBSERVABILITY.read_text()
    assert [r.value for r in FailureReason if f"`{r.value}`" not in failures] == []
    assert [r.value for r in SaveSkipReason if f"`{r.value}`" not in observability] == []


def test_dashboards_page_names_every_app_tab_grafana_row_and_alert():
    from grafana.panels import ROWS as GRAFANA_ROWS

    page = re.sub(r"\s+", " ", DASHBOARDS.read_text())
    app = ast.parse((md.REPO / "dashboard" / "app.py").read_text())
    app_rows = next(
        ast.literal_eval(node.value)
        for node in app.body
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["ROWS"]
    )
    tabs = page.split("- **Tabs**:", 1)[1].split(" - ", 1)[0]
    assert [row for row in app_rows if f"*{row}*" not in tabs] == []
    rows = page.split("The dashboard has rows", 1)[1].split(";", 1)[0]
    assert [row for row in GRAFANA_ROWS if f"*{row}*" not in rows] == []
    rules = yaml.safe_load((md.REPO / "grafana" / "prometheus" / "rules" / "kvlens-alerts.yml").read_text())
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"]}
    shown = {
        name
        for row in table(DASHBOARDS, "Grafana, Prometheus and traces")
        for name in re.findall(r"`(\w+)`", row[0])
    }
    assert shown == alerts
