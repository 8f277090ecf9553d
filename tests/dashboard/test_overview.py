"""The Overview's numbers on hand-written sample frames with known answers."""

from __future__ import annotations

import pytest

from dashboard import overview
from dashboard.catalog import VLLM_PREFILL_SECONDS_SUM, VLLM_PROMPT_BY_SOURCE

from .frames import frame, row, series

HITS = "vllm:kvlens_hit_tokens_total"
LOOKUPS = "vllm:kvlens_lookup_tokens_total"


def test_hit_rate_is_missing_not_nan_when_nothing_was_looked_up():
    f = frame(*series(HITS, [0, 50, 50, 50], tier="cpu"), *series(LOOKUPS, [0, 100, 100, 100]))
    r = overview.hit_rates(f, window_s=10)
    assert list(r.index) == [10]
    assert r.loc[10, "KVLens, tokens"] == pytest.approx(0.5)


def test_savings_estimate_prefill_seconds_from_the_engines_measured_cost():
    f = frame(
        row(0, "vllm:kvlens_load_tokens_total", 0, tier="cpu"),
        row(10, "vllm:kvlens_load_tokens_total", 1000, tier="cpu"),
        row(0, "vllm:kvlens_load_tokens_total", 200, tier="disk"),
        row(10, "vllm:kvlens_load_tokens_total", 500, tier="disk"),
        row(10, VLLM_PROMPT_BY_SOURCE, 3000, source="local_compute"),
        row(10, VLLM_PREFILL_SECONDS_SUM, 3.0),  # batched requests' overlapping prefill times: unused
        row(0, "vllm:kvlens_prefill_seconds_per_token", 0.002),
        row(10, "vllm:kvlens_prefill_seconds_per_token", 0.0005),  # the latest measure counts
        row(10, LOOKUPS, 6000),
        row(10, HITS, 1500, tier="cpu"),
    )
    s = overview.savings(f)
    assert s.loaded_tokens == 1500  # since the server started
    assert s.loaded_tokens_window == 1000 + 300  # while the dashboard watched
    assert s.prefill_s_per_token == pytest.approx(0.0005)
    assert s.seconds_saved == pytest.approx(0.75)
    assert s.hit_rate == pytest.approx(0.25)


def test_savings_has_no_estimate_before_the_engine_measured_a_prefill():
    s = overview.savings(
        frame(
            row(0, "vllm:kvlens_load_tokens_total", 0, tier="cpu"),
            row(0, VLLM_PROMPT_BY_SOURCE, 3000, source="local_compute"),
            row(0, VLLM_PREFILL_SECONDS_SUM, 1.5),
        )
    )
    assert s.seconds_saved is None and s.hit_rate is None


def test_instance_table_has_one_row_per_instance():
    f = frame(
        row(0, LOOKUPS, 100, "a:1"),
        row(0, HITS, 50, "a:1", tier="cpu"),
        row(0, LOOKUPS, 100, "b:1"),
        row(0, HITS, 0, "b:1", tier="cpu"),
    )
    t = overview.instance_table(f)
    assert list(t.index) == ["a:1", "b:1"]
    assert list(t["KVLens hit rate"]) == [0.5, 0.0]
