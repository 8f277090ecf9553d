"""The Blending tab's numbers on a hand-written sample frame with known answers, and the tab
itself when nothing blended."""

from __future__ import annotations

import numpy as np
import pytest

from dashboard import blend_page

from .frames import frame, series

TOKENS = "vllm:kvlens_blend_tokens_total"
REQUESTS = "vllm:kvlens_blend_requests_total"
BY_TENANT = "vllm:kvlens_tenant_blend_tokens_total"


def blending():
    """Two instances, each blending one 1000-token prompt per 10 s: 700 reused, 100 of them
    recomputed by deviation, 300 not stored (so 400 recomputed)."""
    rows = []
    for instance in ("a:8000", "b:8000"):
        rows += series(TOKENS, [0, 700, 1400], instance, kind="reused")
        rows += series(TOKENS, [0, 400, 800], instance, kind="recomputed")
        rows += series(TOKENS, [0, 100, 200], instance, kind="recomputed_by_deviation")
        rows += series(TOKENS, [0, 300, 600], instance, kind="not_stored")
        rows += series(REQUESTS, [0, 1, 2], instance, outcome="blended")
        rows += series(REQUESTS, [0, 0, 0], instance, outcome="failed")
    return frame(*rows)


def test_tokens_by_kind_are_summed_over_instances_per_second():
    shown = blend_page.tokens_by_kind(blending(), window_s=10)
    last = shown.iloc[-1]
    assert last["reused (from a tier)"] == pytest.approx(140.0)  # 2 x 700 per 10 s
    assert last["recomputed: deviated most"] == pytest.approx(20.0)
    assert last["computed: not stored"] == pytest.approx(60.0)


def test_the_recomputed_share_is_recomputed_over_every_blended_token():
    share = blend_page.recomputed_share(blending(), window_s=10)
    assert np.allclose(share.dropna().to_numpy(), 0.4)  # 400 of 700 + 300


def test_the_tab_says_when_nothing_blended(monkeypatch):
    shown = []
    monkeypatch.setattr(blend_page.st, "info", shown.append)
    idle = frame(*series(REQUESTS, [0, 0], outcome="blended"), *series(REQUESTS, [0, 0], outcome="failed"))
    blend_page.show(idle, 10)
    assert shown == [blend_page.NONE_YET]


def test_per_tenant_totals_are_summed_over_instances_and_idle_tenants_left_out():
    rows = []
    for instance in ("a:8000", "b:8000"):
        rows += series(BY_TENANT, [0, 600, 900], instance, tenant="salt:1f", kind="reused")
        rows += series(BY_TENANT, [0, 100, 300], instance, tenant="salt:1f", kind="recomputed")
        rows += series(BY_TENANT, [0, 0, 50], instance, tenant="default", kind="recomputed")
        rows += series(BY_TENANT, [0, 0, 0], instance, tenant="other", kind="reused")
        rows += series(BY_TENANT, [0, 0, 0], instance, tenant="other", kind="recomputed")
    table = blend_page.by_tenant(frame(*rows))
    assert list(table.index) == ["salt:1f", "default"]
    assert table.loc["salt:1f", "reused"] == 1800 and table.loc["salt:1f", "recomputed"] == 600
    assert table.loc["salt:1f", "recomputed share"] == pytest.approx(0.25)
    assert table.loc["default", "recomputed share"] == 1.0
