"""The dashboards' prefill cost per computed token, on a canned scrape where two requests'
prefills overlap (batched in one engine step): vLLM times each request's prefill on its own, so
adding those times up over the computed tokens counts the shared step twice. The panels must
give the wall-clock cost: 1.0 s for 1000 tokens."""

from __future__ import annotations

import json
import subprocess

from prometheus_client.parser import text_string_to_metric_families

from connector.engine.prefill_cost import PrefillCostMeter
from dashboard import overview, sources
from grafana.panels import PANELS, with_selector

from .conftest import DATA
from .promql import concrete

SCRAPE = (DATA / "metrics-overlapping-prefills.txt").read_text()
STEP_S, TOKENS = 1.0, 1000  # the one step that computed both prompts, and their tokens
TRUE_COST = STEP_S / TOKENS
LOADED = 600  # tokens KVLens loaded afterwards
INSTANCE = "a:8000"


def test_the_canned_engine_measure_is_what_the_meter_gives_for_these_steps():
    meter = PrefillCostMeter()
    t = 0.0
    for _ in range(8):  # both prompts in one step, then their decodes (1 ms a step)
        meter.step(t, prefill_tokens=TOKENS, total_tokens=TOKENS, requests=["a", "b"])
        meter.step(t + STEP_S, prefill_tokens=0, total_tokens=2, requests=["a", "b"])
        t += STEP_S + 0.001
    (gauge,) = [
        s.value for f in text_string_to_metric_families(SCRAPE) for s in f.samples if "per_token" in s.name
    ]
    assert meter.seconds_per_token == gauge == TRUE_COST


def input_series() -> list[dict]:
    """The scrape as promtool input, one sample a minute: counters 0, 0, then the scrape's value
    twice (they started at zero); gauges the scrape's value throughout."""
    out = []
    for family in text_string_to_metric_families(SCRAPE):
        for s in family.samples:
            labels = ", ".join(f'{k}="{v}"' for k, v in {**s.labels, "instance": INSTANCE}.items())
            v = f"{s.value:g}"
            values = f"{v} {v} {v} {v}" if family.type == "gauge" else f"0 0 {v} {v}"
            out.append({"series": f"{s.name}{{{labels}}}", "values": values})
    return out


def panel_expr(title_start: str) -> str:
    (panel,) = [p for p in PANELS if p.title.startswith(title_start)]
    (target,) = panel.targets
    return concrete(with_selector(target.expr), rate_interval="3m", range_="3m")


def promtool_eval(tmp_path, expr: str, labels: str, value: float) -> subprocess.CompletedProcess:
    test = {
        "tests": [
            {
                "interval": "1m",
                "input_series": input_series(),
                "promql_expr_test": [
                    {"expr": expr, "eval_time": "3m", "exp_samples": [{"labels": labels, "value": value}]}
                ],
            }
        ]
    }
    (tmp_path / "panel.test.yml").write_text(json.dumps(test))
    return subprocess.run(
        ["promtool", "test", "rules", "panel.test.yml"], cwd=tmp_path, capture_output=True, text=True
    )


def test_the_grafana_cost_panel_gives_the_wall_clock_cost_per_computed_token(tmp_path):
    expr = panel_expr("Prefill seconds per computed token")
    out = promtool_eval(tmp_path, expr, f'{{instance="{INSTANCE}"}}', TRUE_COST)
    assert out.returncode == 0, expr + "\n" + out.stdout + out.stderr


def test_the_grafana_time_saved_fallback_uses_the_wall_clock_cost(tmp_path):
    expr = panel_expr("Prefill time saved (estimated)")
    out = promtool_eval(tmp_path, expr, "{}", LOADED * TRUE_COST)
    assert out.returncode == 0, expr + "\n" + out.stdout + out.stderr


def test_the_apps_cost_and_time_saved_use_the_wall_clock_cost():
    zeros = "\n".join(
        line if line.startswith("#") else f"{line.rsplit(' ', 1)[0]} 0.0"
        for line in SCRAPE.splitlines()
        if "per_token" not in line
    )
    scrapes = iter([zeros, SCRAPE])
    history = sources.MetricsHistory(f"http://{INSTANCE}/metrics", fetch=lambda url: next(scrapes))
    history.scrape(now=0.0)
    history.scrape(now=10.0)
    s = overview.savings(history.frame())
    assert s.prefill_s_per_token == TRUE_COST
    assert s.seconds_saved == LOADED * TRUE_COST
