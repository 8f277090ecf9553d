"""The runner every bench script shares (bench/lib/runner.py), on a benchmark measured in this
process: modes take turns in an order reversed every repetition, ratios pair each repetition with
the baseline's, a mode that fails leaves the run with what it measured, and targets, checks and
the JSON come out in the one report format. Fast: no vLLM."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest

from bench.lib import runner
from bench.lib.runner import Benchmark, Case, Check, Figure, Option, Side, SideFailed, Target, main

PER_MODE_MS = {"base": 10.0, "fast": 5.0, "flaky": 20.0}


class Toy(Benchmark):
    name = "toy"
    figures = (Figure("ms", "ms", "{:.1f}", ratio=True), Figure("ok", "ok"))
    baselines = ("base",)
    targets = (Target("fast <= 0.6 x base", "ms", 0.6, baseline="base", mode_prefix="fast"),)
    checks = (Check("ok", "answered wrong"),)
    repeats = (4, 2)
    repeat_flags = ("--rounds",)
    options = {"size": Option(100, 1, "cases: one when 1, else small and large")}
    turns: list[tuple[str, int, str]] = []

    def sides(self):
        return [Side(name) for name in PER_MODE_MS]

    def cases(self):
        return [Case("small", 1), Case("large", 3)] if self.args.size > 1 else [Case("all", 1)]

    def measure(self, side, case, rep):
        Toy.turns.append((case.name, rep, side.name))
        if side.name == "flaky" and rep == 1:
            raise SideFailed("its server went away")
        # Absolute times drift with the repetition (a busy machine); the ratios do not.
        return {"ms": PER_MODE_MS[side.name] * case.params * (rep + 1), "ok": side.name != "flaky"}


@pytest.fixture
def run(tmp_path, capsys):
    def go(*argv: str) -> tuple[dict, str]:
        Toy.turns = []
        assert main(Toy, [*argv, "--out", str(tmp_path)]) == 0
        return json.loads((tmp_path / "toy.json").read_text()), capsys.readouterr().out

    return go


def test_modes_take_turns_in_an_order_reversed_every_repetition(run):
    run("--quick", "--modes", "base,fast")
    assert Toy.turns == [("all", 0, "base"), ("all", 0, "fast"), ("all", 1, "fast"), ("all", 1, "base")]


def test_ratios_pair_each_repetition_with_the_baselines(run):
    data, _ = run("--rounds", "3")
    for case in ("small", "large"):
        assert data["summary"][case]["fast"]["ms"]["max"] == 3 * data["summary"][case]["fast"]["ms"]["min"]
        assert data["ratios"][case]["fast"]["base"]["ms"] == {
            "median": 0.5,
            "min": 0.5,
            "max": 0.5,
            "n": 3,
            "sum": 1.5,
        }
    assert data["cases"] == ["small", "large"]


def test_a_failing_mode_leaves_the_run_with_what_it_measured(run):
    data, out = run("--quick")
    assert [r["repetition"] for r in data["raw"]["all"]["flaky"]] == [0]
    assert len(data["raw"]["all"]["fast"]) == 2
    assert ("all", 1, "flaky") in Toy.turns and data["unavailable"]["flaky"].startswith(
        "failed in repetition 2"
    )
    assert "flaky: unavailable: failed in repetition 2 (its server went away)" in out
    assert data["ratios"]["all"]["flaky"]["base"]["ms"]["n"] == 1


def test_targets_checks_and_tables_are_reported(run):
    data, out = run("--quick")
    (target,) = data["targets"]
    assert target["mode"] == "fast" and target["met"] is True and math.isclose(target["values"]["all"], 0.5)
    assert "target fast <= 0.6 x base, fast: 0.500 -> met" in out
    assert "NOTE: flaky: answered wrong" in out and data["summary"]["all"]["flaky"]["ok"] == {
        "all": False,
        "n": 1,
    }
    assert "| mode  |                ms |  ok |" in out
    assert "| fast  |   7.5 (5.0..10.0) | yes |" in out
    assert data["settings"]["size"] == 1 and data["settings"]["repeats"] == 2


def test_options_take_their_quick_defaults_and_show_both(run, capsys):
    data, _ = run("--quick", "--size", "7")
    assert data["settings"]["size"] == 7 and data["cases"] == ["small", "large"]
    with pytest.raises(SystemExit):
        main(Toy, ["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default 100; --quick 1)" in out and "--repeats REPEATS, --rounds REPEATS" in out


def test_out_may_name_the_json_file(tmp_path):
    Toy.turns = []
    assert main(Toy, ["--quick", "--modes", "base", "--out", str(tmp_path / "elsewhere.json")]) == 0
    assert json.loads((tmp_path / "elsewhere.json").read_text())["benchmark"] == "toy"


def test_unknown_modes_are_refused_with_the_known_ones():
    with pytest.raises(SystemExit, match="unknown slow; known: base, fast, flaky"):
        main(Toy, ["--quick", "--modes", "base,slow"])


def test_the_example_in_the_runners_docstring_runs(tmp_path):
    doc = runner.__doc__
    code = textwrap.dedent(doc[doc.index("::\n") + 3 : doc.index("``python bench/copy_cost.py")])
    example = {"__name__": "copy_cost", "__file__": str(Path(runner.__file__).parents[1] / "copy_cost.py")}
    exec(compile(code, "copy_cost.py", "exec"), example)
    assert example["main"](example["CopyCost"], ["--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "copy_cost.json").read_text())
    assert data["ratios"]["all"]["copy"]["none"]["ms"]["n"] == 2 and data["settings"]["mb"] == 4
