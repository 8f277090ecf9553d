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


PREFILLER, DECODER = "p:8100", "d:8200"


def pd_pair(prompts: int = 2, prompt_tokens: int = 2000) -> pd.DataFrame:
    """A PD pair read every 10 s while it serves one prompt per reading: the prefiller (pd_role
    sender, no tier) computes each prompt and sends it; the decoder (pd_role receiver) loads it
    from what it received and computes only the prefiller's first token, which its prompt adds.
    Every engine exports every PD series, at 0 for the side it is not on."""
    from dashboard import catalog as c

    n = range(prompts + 1)
    rows = [
        *series(c.kvlens("info"), [1] * len(n), PREFILLER, pd_role="sender", role="kv_producer"),
        *series(c.kvlens("info"), [1] * len(n), DECODER, pd_role="receiver", role="kv_consumer"),
    ]
    for instance, tokens, computed, received in (
        (PREFILLER, prompt_tokens, prompt_tokens, 0),
        (DECODER, prompt_tokens + 1, 1, prompt_tokens),
    ):
        rows += series(c.kvlens("lookup_tokens"), [i * tokens for i in n], instance)
        rows += series(c.kvlens("lookup_requests"), list(n), instance)
        rows += series(c.VLLM_PROMPT_BY_SOURCE, [i * computed for i in n], instance, source="local_compute")
        rows += series(c.VLLM_CACHED_BY_SOURCE, [i * received for i in n], instance, source="p2p")
        rows += series(c.PD_LOADED_TOKENS, [i * received for i in n], instance)
    rows += series(c.PD_LOADS, list(n), DECODER, outcome="loaded")
    return frame(*rows)
