"""Sample frames as ``dashboard.sources`` builds them, written by hand for the view tests."""

from __future__ import annotations

import pandas as pd

from dashboard.catalog import LABELS
from dashboard.sources import COLUMNS


def row(t: float, name: str, value: float, instance: str = "a:8000", **labels: str) -> tuple:
    return (float(t), instance, name, *(labels.get(k, "") for k in LABELS), float(value))


def frame(*rows: tuple) -> pd.DataFrame:
    return pd.DataFrame(list(rows), columns=list(COLUMNS))


def series(
    name: str, values: list[float], instance: str = "a:8000", start: float = 0.0, step: float = 10.0, **labels
):
    """One series sampled every ``step`` seconds from ``start``."""
    return [row(start + i * step, name, v, instance, **labels) for i, v in enumerate(values)]
