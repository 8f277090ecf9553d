"""PromQL helpers for the dashboard tests: the dashboard's variables made concrete, the metric
names an expression uses, and checks of its conventions."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path

from grafana.panels import PANELS, with_selector

REPO = Path(__file__).resolve().parents[2]
DASHBOARD_JSON = REPO / "grafana" / "dashboards" / "kvlens.json"
RULES = REPO / "grafana" / "prometheus" / "rules" / "kvlens-alerts.yml"

_NAME = re.compile(r"\b(vllm:[A-Za-z0-9_:]+)")
_WINDOW = re.compile(r"\[([^\]]+)\]")


def concrete(expr: str, rate_interval: str = "1m", range_: str = "10m", interval: str = "15s") -> str:
    """Grafana's variables replaced the way Grafana would for one query."""
    for var, value in (
        ("$__rate_interval", rate_interval),
        ("$__range", range_),
        ("$__interval", interval),
        ("$model_name", ".*"),
        ("$instance", ".*"),
    ):
        expr = expr.replace(var, value)
    return expr


def metric_names(expr: str) -> set[str]:
    return set(_NAME.findall(expr))


_PROXY_NAME = re.compile(r"\b(kvlens_pd_proxy_[A-Za-z0-9_]+)")


def proxy_names(expr: str) -> set[str]:
    """The PD proxy's metric names (``kvlens_pd_proxy_*``: not vLLM series) an expression uses."""
    return set(_PROXY_NAME.findall(expr))


def windows(expr: str) -> list[str]:
    return _WINDOW.findall(expr)


def dashboard() -> dict:
    return json.loads(DASHBOARD_JSON.read_text())


def dashboard_panels() -> list[dict]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def dashboard_exprs() -> list[str]:
    """Every PromQL expression the dashboard JSON runs: targets, annotations, variables."""
    d = dashboard()
    out = [t["expr"] for p in dashboard_panels() for t in p["targets"]]
    out += [a["expr"] for a in d["annotations"]["list"] if a.get("expr")]
    return out


def rule_exprs() -> list[str]:
    import yaml

    return [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def panel_queries() -> list[tuple[str, str, str]]:
    """(panel title, legend, concrete PromQL) for every target of ``grafana.panels.PANELS``."""
    return [(p.title, t.legend, with_selector(t.expr)) for p in PANELS for t in p.targets]


def outside_rate(expr: str, suffix: str = "_total") -> list[str]:
    """Names ending in ``suffix`` that are not directly inside rate()/increase()/irate()."""
    bad = []
    for m in _NAME.finditer(expr):
        if not m.group(1).endswith(suffix):
            continue
        depth, i = 0, m.start() - 1
        while i >= 0:  # find the innermost unclosed "(" before the name
            if expr[i] == ")":
                depth += 1
            elif expr[i] == "(":
                if depth == 0:
                    break
                depth -= 1
            i -= 1
        func = re.search(r"([a-z_]+)\s*$", expr[:i]) if i >= 0 else None
        if func is None or func.group(1) not in ("rate", "increase", "irate"):
            bad.append(m.group(1))
    return bad


def _group(text: str) -> str:
    """The inside of the parenthesised group ``text`` starts with."""
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            return text[1:i]
    return text[1:]


def unguarded_divisions(expr: str) -> int:
    """Divisions whose denominator is not ``( ... > 0)``."""
    count = 0
    for m in re.finditer(r"/", expr):
        rest = expr[m.end() :].lstrip()
        if not rest.startswith("(") or not re.search(r">\s*0\s*$", _group(rest)):
            count += 1
    return count


def promtool_parse(exprs: Iterable[str], tmp: Path) -> subprocess.CompletedProcess:
    """``promtool check rules`` on the expressions as recording rules: a PromQL syntax check."""
    rules = {
        "groups": [
            {"name": "parse", "rules": [{"record": f"parse:{i}", "expr": e} for i, e in enumerate(exprs)]}
        ]
    }
    path = tmp / "parse.rules.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    return subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )


def promtool_test(tmp: Path, input_series: list[dict], expr_tests: list[dict], interval: str = "1m"):
    """``promtool test rules`` of PromQL expressions on input series: each of ``expr_tests`` is
    ``{"expr", "eval_time", "exp_samples"}`` (Prometheus's unit-test format)."""
    test = {"tests": [{"interval": interval, "input_series": input_series, "promql_expr_test": expr_tests}]}
    (tmp / "exprs.test.yml").write_text(json.dumps(test))  # JSON is YAML
    return subprocess.run(
        ["promtool", "test", "rules", "exprs.test.yml"], cwd=tmp, capture_output=True, text=True, timeout=120
    )
