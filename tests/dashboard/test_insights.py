"""The Insights view's computations on hand-written sample frames with known answers."""

from __future__ import annotations

import sys
import types

import pytest

from dashboard import catalog, charts, insights, overview
from dashboard.catalog import BUDGET_FACTORS, VLLM_EXTERNAL_HITS

from .frames import frame, row, series

WHATIF = "vllm:kvlens_whatif_hit_ratio"
INFO = "vllm:kvlens_info"
SAVED = "vllm:kvlens_prefill_seconds_saved_total"
SPENT = "vllm:kvlens_operation_seconds_sum"


def _curve_rows(instance: str, tier: str, ratios: list[float], t: float = 10.0) -> list[tuple]:
    return [
        row(t, WHATIF, r, instance, tier=tier, budget_factor=f)
        for f, r in zip(BUDGET_FACTORS, ratios, strict=True)
    ]


RATIOS = [0.1, 0.2, 0.3, 0.4, 0.55, 0.6, 0.6, 0.6]


def test_whatif_curve_keeps_the_latest_reading_with_factors_as_numbers():
    f = frame(*_curve_rows("a:1", "cpu", [0.0] * 8, t=0), *_curve_rows("a:1", "cpu", RATIOS))
    curves = insights.whatif_curves(f)
    assert list(curves["factor"]) == [0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0]
    assert list(curves["ratio"]) == RATIOS and set(curves["series"]) == {"cpu"}
    assert insights.curve_of(curves, "cpu")[1.0] == 0.4


def test_whatif_curves_name_the_instance_when_there_are_several():
    f = frame(*_curve_rows("a:1", "cpu", RATIOS), *_curve_rows("b:1", "disk", RATIOS))
    assert set(insights.whatif_curves(f)["series"]) == {"a:1 cpu", "b:1 disk"}
    assert insights.whatif_curves(frame(row(0, catalog.kvlens("lookup_tokens"), 1))).empty


def test_whatif_chart_marks_the_configured_size_on_a_log2_axis():
    spec = charts.whatif(insights.whatif_curves(frame(*_curve_rows("a:1", "cpu", RATIOS)))).to_dict()
    x = spec["layer"][0]["encoding"]["x"]
    assert x["scale"]["type"] == "log" and x["scale"]["base"] == 2
    assert spec["layer"][1]["mark"]["type"] == "rule"


def test_sizing_advice_is_none_without_the_connector_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "connector.engine.whatif", None)  # import raises ImportError
    assert insights.sizing_advice({0.5: 0.1, 1.0: 0.2}, "cpu") is None


def test_sizing_advice_hands_the_connector_a_curve_with_float_factors(monkeypatch):
    seen = []
    fake = types.ModuleType("connector.engine.whatif")
    fake.sizing_advice = lambda curve, tier: seen.append((curve, tier)) or f"{tier}: {curve[1.0]:.0%}"
    monkeypatch.setitem(sys.modules, "connector.engine.whatif", fake)
    curve = insights.curve_of(insights.whatif_curves(frame(*_curve_rows("a:1", "cpu", RATIOS))), "cpu")
    assert insights.sizing_advice(curve, "cpu") == "cpu: 40%"
    assert seen == [(dict(zip([0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0], RATIOS, strict=True)), "cpu")]
    assert insights.sizing_advice({2.0: 0.5}, "cpu") is None  # no configured size: no advice


def _info(instance: str, fingerprint: str, storage: str, chunk: str = "256", t: float = 0.0) -> tuple:
    return row(
        t,
        INFO,
        1,
        instance,
        version="0.4.0",
        chunk_size=chunk,
        key_fingerprint=fingerprint,
        tiers="cpu+disk",
        role="kv_both",
        storage=storage,
    )


def test_instances_sharing_a_storage_entry_and_a_key_form_one_group():
    f = frame(
        _info("a:1", "aaaaaaaaaaaa", "disk:1111,remote:redis://h:6379/0"),
        _info("b:1", "aaaaaaaaaaaa", "remote:redis://h:6379/0"),
        _info("c:1", "aaaaaaaaaaaa", "disk:1111"),  # shares the disk with a only
        _info("d:1", "bbbbbbbbbbbb", "disk:1111"),  # another key: no sharing
        _info("e:1", "aaaaaaaaaaaa", "disk:1111", chunk="128"),  # another chunk size
        _info("f:1", "aaaaaaaaaaaa", ""),  # no shared tier
    )
    t = insights.instance_identity(f)
    assert list(t.index) == ["a:1", "b:1", "c:1", "d:1", "e:1", "f:1"]
    assert list(t["group"]) == [1, 1, 1, 2, 3, 4]
    assert t.loc["a:1", "can share with"] == "b:1, c:1" and t.loc["b:1", "can share with"] == "a:1"
    assert list(t["alone"]) == [False, False, False, True, True, True]
    assert t.loc["a:1", "key fingerprint"] == "aaaaaaaaaaaa" and t.loc["a:1", "chunk size"] == "256"


def test_an_instance_is_described_by_its_latest_info_series():
    f = frame(_info("a:1", "aaaaaaaaaaaa", "disk:1", t=0), _info("a:1", "cccccccccccc", "disk:1", t=10))
    assert list(insights.instance_identity(f)["key fingerprint"]) == ["cccccccccccc"]
    assert insights.instance_identity(frame(row(0, catalog.kvlens("lookup_tokens"), 1))).empty


def test_storage_entries():
    assert insights.storage_entries("disk:3f2a91c0,remote:redis://h:6379/0") == {
        "disk:3f2a91c0",
        "remote:redis://h:6379/0",
    }
    assert insights.storage_entries("") == frozenset()


def test_reconciliation_has_the_three_token_rates():
    f = frame(
        *series(VLLM_EXTERNAL_HITS, [0, 80, 160]),
        *series("vllm:kvlens_hit_tokens_total", [0, 100, 200], tier="cpu"),
        *series("vllm:kvlens_load_tokens_total", [0, 40, 80], tier="cpu"),
    )
    r = insights.reconciliation(f, window_s=10)
    assert r.loc[20].to_dict() == {
        "vLLM external hits": 8.0,
        "KVLens held at lookup": 10.0,
        "KVLens loaded": 4.0,
    }


def test_time_balance_sets_prefill_saved_against_kvlens_time():
    f = frame(
        *series(SAVED, [0, 2, 4], tier="cpu"),
        *series(SAVED, [0, 1, 1], tier="disk"),
        *series(SPENT, [0, 0.5, 1.0], operation="load"),
        *series(SPENT, [0, 0.1, 0.2], operation="lookup"),
        *series("vllm:kvlens_prefill_seconds_per_token", [0.001, 0.002, 0.003]),
    )
    r = insights.time_balance(f, window_s=10)
    assert r.loc[20, "saved, cpu"] == pytest.approx(0.2) and r.loc[20, "KVLens load"] == pytest.approx(0.05)
    b = insights.balance(f)
    assert b.saved_s == 5 and b.spent_s == pytest.approx(1.2) and b.net_s == pytest.approx(3.8)
    assert b.per_token_s == 0.003
    assert overview.savings(f).seconds_saved == 5  # the overview prefers the connector's estimate


def test_time_balance_without_the_connectors_estimate():
    b = insights.balance(frame(*series(SPENT, [0, 0.5], operation="load")))
    assert b.saved_s is None and b.net_s is None and b.per_token_s is None and b.spent_s == 0.5


def test_the_insight_metrics_are_known_to_the_dashboard():
    assert {"vllm:kvlens_info", "vllm:kvlens_prefill_seconds_saved_total"} <= catalog.kvlens_sample_names()


def test_every_miss_reason_the_connector_counts_is_explained():
    from connector.engine.outcomes import MissReason

    assert {r.value for r in MissReason} <= set(catalog.MISS_REASONS)
    assert {"other_namespace", "load_failed"} <= set(catalog.MISS_REASONS)
