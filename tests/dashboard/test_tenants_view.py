"""The Tenants tab's numbers on hand-written sample frames with known answers."""

from __future__ import annotations

import numpy as np

from dashboard import tenants

from .frames import frame, series

LOOKUP = "vllm:kvlens_tenant_lookup_tokens_total"
HIT = "vllm:kvlens_tenant_hit_tokens_total"
LOAD = "vllm:kvlens_tenant_load_tokens_total"
BYTES = "vllm:kvlens_tenant_bytes"
ALICE = "salt:3fa1c2d90b"


def two_tenants_on_two_instances():
    rows = []
    for instance in ("a:8000", "b:8000"):
        rows += series(LOOKUP, [0, 1000, 2000], instance, tenant=ALICE)
        rows += series(HIT, [0, 500, 1500], instance, tenant=ALICE)
        rows += series(LOAD, [0, 400, 1400], instance, tenant=ALICE)
        rows += series(LOOKUP, [0, 100, 200], instance, tenant="default")
        rows += series(HIT, [0, 0, 0], instance, tenant="default")
        rows += series(LOAD, [0, 0, 0], instance, tenant="default")
        rows += series(BYTES, [0, 2e6, 3e6], instance, tenant=ALICE, tier="cpu")
        rows += series(BYTES, [0, 0, 1e6], instance, tenant=ALICE, tier="disk")
        rows += series(BYTES, [0, 0, 0], instance, tenant="default", tier="cpu")
    return frame(*rows)


def test_hit_ratio_per_tenant_over_the_window_and_missing_without_lookups():
    f = frame(
        *series(LOOKUP, [0, 1000, 2000, 2000], tenant=ALICE),
        *series(HIT, [0, 500, 1500, 1500], tenant=ALICE),
    )
    r = tenants.hit_ratios(f, window_s=10)
    assert np.allclose(r[ALICE].to_numpy(), [0.5, 1.0])  # idle at t=30: no ratio, not 0 or NaN


def test_table_sums_instances_and_puts_the_busiest_tenant_first():
    t = tenants.table(two_tenants_on_two_instances())
    assert list(t.index) == [ALICE, "default"]
    assert t.loc[ALICE, "looked up (tokens)"] == 4000 and t.loc[ALICE, "held (tokens)"] == 3000
    assert t.loc[ALICE, "hit ratio"] == 0.75 and t.loc["default", "hit ratio"] == 0
    assert t.loc[ALICE, "loaded (tokens)"] == 2800
    assert t.loc[ALICE, "bytes held (cpu)"] == 6e6 and t.loc[ALICE, "bytes held (disk)"] == 2e6
    assert t.loc["default", "bytes held (disk)"] == 0


def test_bytes_held_per_tenant_and_tier_and_loads_per_tenant():
    f = two_tenants_on_two_instances()
    held = tenants.bytes_held(f)
    assert held[f"{ALICE} cpu"].iloc[-1] == 6e6
    loads = tenants.loaded(f, window_s=10)
    assert np.allclose(loads[ALICE].to_numpy(), [80.0, 200.0])


def test_without_tenant_series_the_tab_has_nothing_to_show():
    f = frame(*series("vllm:kvlens_lookup_tokens_total", [0, 1]))
    assert not tenants.has_tenants(f) and tenants.table(f).empty
