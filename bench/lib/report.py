"""Statistics, the printed table, the JSON file and the PNG plot of a benchmark run.

Figures are medians with their spread (min..max over repetitions), because on a small shared
machine a single number hides how much the next run may differ.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max and count (NaN for an empty list)."""
    if not values:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def spread(s: dict[str, float], fmt: str = "{:.3f}") -> str:
    """``median (min..max)``; just the median for a single value; ``-`` for none."""
    if not s.get("n"):
        return "-"
    med = fmt.format(s["median"])
    if s["n"] == 1:
        return med
    return f"{med} ({fmt.format(s['min'])}..{fmt.format(s['max'])})"


class Table:
    """A plain-text table with aligned columns."""

    def __init__(self, headers: Sequence[str]) -> None:
        self.headers = list(headers)
        self.rows: list[list[str]] = []

    def add(self, *cells: object) -> None:
        self.rows.append([str(c) for c in cells])

    def add_span(self, first: object, text: str) -> None:
        """A row whose text runs across every column after the first (e.g. why a mode is missing);
        it does not widen the columns."""
        self.rows.append([str(first), text])

    def render(self) -> str:
        full = [r for r in [self.headers, *self.rows] if len(r) == len(self.headers)]
        widths = [max(len(r[i]) for r in full) for i in range(len(self.headers))]
        widths[0] = max([widths[0], *(len(r[0]) for r in self.rows)])
        lines = ["  ".join(h.ljust(w) for h, w in zip(self.headers, widths, strict=True))]
        lines.append("  ".join("-" * w for w in widths))
        for row in self.rows:
            if len(row) != len(self.headers):
                lines.append("  ".join([row[0].ljust(widths[0]), *row[1:]]))
                continue
            cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
            lines.append("  ".join(cells))
        return "\n".join(lines)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=_jsonable) + "\n")


def _jsonable(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and math.isnan(value):
        return None
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


@dataclass
class Series:
    label: str
    stats: list[dict[str, float]]  # one summary() per category


@dataclass
class Panel:
    title: str
    ylabel: str
    categories: list[str]
    series: list[Series]
    target: float | None = None  # a horizontal line (a goal, or 1.0 for ratios)
    target_label: str = ""
    log: bool = False
    notes: list[str] = field(default_factory=list)


def plot(path: Path, title: str, panels: list[Panel], footnote: str = "") -> Path | None:
    """Grouped bars (medians) with min..max whiskers, one panel per figure of merit.
    Returns None (and says so) when matplotlib is missing: the JSON and the table still exist."""
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
    n = max(len(panel.series), 1)
    width = 0.8 / n
    xs = range(len(panel.categories))
    for j, series in enumerate(panel.series):
        pos = [x - 0.4 + width * (j + 0.5) for x in xs]
        med = [s["median"] if s.get("n") else math.nan for s in series.stats]
        low = [max(m - s["min"], 0) if s.get("n") else 0 for m, s in zip(med, series.stats, strict=True)]
        high = [max(s["max"] - m, 0) if s.get("n") else 0 for m, s in zip(med, series.stats, strict=True)]
        ax.bar(pos, med, width * 0.92, yerr=[low, high], capsize=3, label=series.label)
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
    for i, note in enumerate(panel.notes):
        ax.text(0.01, 0.98 - 0.06 * i, note, transform=ax.transAxes, fontsize=7, va="top")


def _short(value: float) -> str:
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def first_line(text: str, limit: int) -> str:
    """The first line of ``text``, cut to ``limit`` characters (for a table cell or a log line)."""
    line = (text.strip().splitlines() or [""])[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."
