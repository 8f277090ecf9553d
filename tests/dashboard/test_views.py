"""The dashboard's computations on hand-written sample frames with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dashboard import views
from dashboard.catalog import VLLM_RUNNING, VLLM_WAITING

from .frames import frame, row, series

HITS = "vllm:kvlens_hit_tokens_total"
LOOKUPS = "vllm:kvlens_lookup_tokens_total"


def test_rate_of_a_steady_counter_is_its_slope():
    f = frame(*series(HITS, [0, 100, 200, 300, 400], tier="cpu"))
    r = views.rate(f, HITS, window_s=20)
    assert list(r.index) == [10, 20, 30, 40]
    assert np.allclose(r[HITS], 10.0)


def test_rate_survives_a_counter_reset():
    f = frame(*series(HITS, [0, 100, 200, 50, 150], tier="cpu"))  # server restarted before t=30
    r = views.rate(f, HITS, window_s=10)
    assert np.allclose(r[HITS].to_numpy(), [10, 10, 5, 10])


def test_a_labelled_counter_that_appears_later_counts_from_zero():
    # failed_blocks{reason} appears with its first increment; the instance was read before.
    f = frame(
        *series(LOOKUPS, [0, 10, 20, 30]),
        row(20, "vllm:kvlens_failed_blocks_total", 4, reason="corrupt"),
        row(30, "vllm:kvlens_failed_blocks_total", 4, reason="corrupt"),
    )
    assert views.scalar(views.increase(f, "vllm:kvlens_failed_blocks_total")) == 4
    r = views.failures(f, window_s=10)
    assert r.loc[20, "failed blocks corrupt"] == pytest.approx(0.4)
    assert r.loc[30, "failed blocks corrupt"] == 0


def test_rates_of_instances_read_at_different_times_add_up():
    f = frame(
        *series(HITS, [0, 100, 200, 300], "a:8000", tier="cpu"),
        *series(HITS, [0, 50, 100, 150], "b:8000", start=5, tier="cpu"),
    )
    r = views.rate(f, HITS, window_s=10)
    assert r.loc[30, HITS] == pytest.approx(15.0)  # a's 10/s plus b's last 5/s


def test_rate_groups_by_label_with_a_prefix():
    f = frame(*series(HITS, [0, 10, 20], tier="cpu"), *series(HITS, [0, 30, 60], tier="disk"))
    r = views.rate(f, HITS, ("tier",), 10, prefix="KVLens ")
    assert sorted(r.columns) == ["KVLens cpu", "KVLens disk"]
    assert r.loc[20, "KVLens disk"] == pytest.approx(3.0)


# Buckets le=0.1: 2, le=0.2: 6, le=1: 10, +Inf: 10 (cumulative). The rank q*10 falls in a
# bucket; the value is interpolated linearly inside it, the first bucket starting at 0.
@pytest.mark.parametrize(
    ("q", "expected"),
    [
        (0.1, 0.1 * 1 / 2),  # rank 1 in (0, 0.1]
        (0.25, 0.1 + 0.1 * 0.5 / 4),  # rank 2.5 in (0.1, 0.2]
        (0.5, 0.1 + 0.1 * 3 / 4),  # rank 5
        (0.9, 0.2 + 0.8 * 3 / 4),  # rank 9 in (0.2, 1]
    ],
)
def test_bucket_quantile_interpolates_like_prometheus(q, expected):
    bounds = np.array([0.1, 0.2, 1.0, math.inf])
    counts = np.array([2.0, 6.0, 10.0, 10.0])
    assert views.bucket_quantile(q, bounds, counts) == pytest.approx(expected)


def test_bucket_quantile_in_the_inf_bucket_is_the_highest_finite_bound():
    assert views.bucket_quantile(0.99, np.array([0.1, 1.0, math.inf]), np.array([1.0, 2.0, 10.0])) == 1.0
    assert math.isnan(views.bucket_quantile(0.5, np.array([0.1, math.inf]), np.array([0.0, 0.0])))


def test_latency_quantiles_from_bucket_counters():
    name = "vllm:kvlens_operation_seconds_bucket"
    rows = []
    for le, values in (("0.001", [0, 10, 20]), ("0.01", [0, 20, 40]), ("+Inf", [0, 20, 40])):
        rows += series(name, values, operation="load", le=le)
    rows += series(name, [0, 5, 5], operation="store", le="+Inf")
    q = views.latency(frame(*rows), "load", window_s=10)
    assert q.loc[10, "p50"] == pytest.approx(0.001)  # rank 10 of 20: top of the first bucket
    assert q.loc[20, "p95"] == pytest.approx(0.001 + 0.009 * (19 - 10) / 10)


def _engine(instance: str, running: list[float], trackers: list[float]) -> list[tuple]:
    return [
        *series(VLLM_RUNNING, running, instance),
        *series(VLLM_WAITING, [0] * len(running), instance),
        *series("vllm:kvlens_request_trackers", trackers, instance),
        *series("vllm:kvlens_pinned_chunks", [0] * len(running), instance, tier="cpu"),
    ]


def test_a_gauge_above_zero_through_an_idle_stretch_is_flagged():
    f = frame(
        *_engine("leaky:1", [2, 1, 0, 0, 0, 0, 0], [2, 2, 1, 1, 1, 1, 1]),
        *_engine("clean:1", [2, 1, 0, 0, 0, 0, 0], [2, 2, 0, 0, 0, 0, 0]),
        *_engine("busy:1", [2, 2, 2, 2, 2, 2, 2], [2, 2, 2, 2, 2, 2, 2]),
        *_engine("brief:1", [2, 2, 2, 2, 2, 0, 0], [2, 2, 2, 2, 2, 1, 1]),
    )
    flags = views.leak_flags(f, idle_for_s=30)
    assert [(x.instance, x.gauge, x.value, x.idle_s) for x in flags] == [
        ("leaky:1", "request_trackers", 1, 40)
    ]


def test_idle_since_is_when_the_last_request_left():
    f = frame(*_engine("a:1", [1, 0, 2, 0, 0], [0, 0, 0, 0, 0]))
    assert views.idle_since(f, "a:1") == 30
    assert views.idle_since(frame(*_engine("a:1", [0, 1], [0, 0])), "a:1") is None


def test_tier_table_reports_fill_and_evictions():
    f = frame(
        row(0, "vllm:kvlens_tier_used_bytes", 512, tier="cpu"),
        row(0, "vllm:kvlens_tier_capacity_bytes", 1024, tier="cpu"),
        row(0, "vllm:kvlens_tier_chunks", 2, tier="cpu"),
        row(0, "vllm:kvlens_evictions_total", 7, tier="cpu"),
        row(0, "vllm:kvlens_tier_used_bytes", 0, tier="disk"),
        row(0, "vllm:kvlens_tier_capacity_bytes", 0, tier="disk"),
    )
    t = views.tier_table(f)
    assert t.loc["cpu", "fill"] == 0.5 and t.loc["cpu", "evictions"] == 7
    assert math.isnan(t.loc["disk", "fill"])


def test_a_disk_directory_two_instances_share_counts_once_their_own_memory_adds_up():
    shared = {"tier": "disk", "storage": "disk:1a2b3c4d"}
    rows = []
    for instance, cpu_used, disk_seen in (("a:1", 100, 3000), ("b:1", 200, 2900)):  # b scanned earlier
        rows += [
            row(0, "vllm:kvlens_tier_used_bytes", cpu_used, instance, tier="cpu"),
            row(0, "vllm:kvlens_tier_capacity_bytes", 1000, instance, tier="cpu"),
            row(0, "vllm:kvlens_tier_used_bytes", disk_seen, instance, **shared),
            row(0, "vllm:kvlens_tier_capacity_bytes", 4000, instance, **shared),
            row(0, "vllm:kvlens_tier_chunks", disk_seen // 100, instance, **shared),
        ]
    rows.append(row(0, "vllm:kvlens_tier_used_bytes", 500, "c:1", tier="disk", storage="disk:99999999"))
    t = views.tier_table(frame(*rows))
    assert t.loc["cpu", "used_bytes"] == 300 and t.loc["cpu", "capacity_bytes"] == 2000
    assert t.loc["disk", "used_bytes"] == 3000 + 500  # the shared directory once, plus another one
    assert t.loc["disk", "capacity_bytes"] == 4000 and t.loc["disk", "chunks"] == 30


def test_remote_round_trips_and_errors_show_when_a_remote_tier_reports():
    name = "vllm:kvlens_remote_seconds_bucket"
    rows = []
    for le, values in (("0.001", [0, 10, 20]), ("+Inf", [0, 10, 20])):
        rows += series(name, values, operation="exists", le=le)
    rows += series("vllm:kvlens_remote_seconds_count", [0, 10, 20], operation="exists")
    rows += series("vllm:kvlens_remote_errors_total", [0, 3, 6], operation="get", kind="timeout")
    f = frame(*rows)
    assert views.has_series(f, "vllm:kvlens_remote_seconds_count")
    assert not views.has_series(frame(*series("vllm:kvlens_lookup_requests_total", [0, 1])), name)
    assert views.remote_round_trips(f, "exists", window_s=10).loc[10, "p50"] == pytest.approx(0.0005)
    errors = views.remote_errors(f, window_s=10)
    assert errors.iloc[-1].sum() == pytest.approx(0.3)


def test_throughput_by_tier_is_bytes_over_the_time_spent_where_they_moved():
    bytes_total, seconds_total = "vllm:kvlens_transfer_bytes_total", "vllm:kvlens_transfer_seconds_total"
    stored = "vllm:kvlens_store_bytes_total"
    f = frame(
        # the disk tier came to hold 2 GB in 10 s, after 1 s of gathers and 3 s of writes
        *series(stored, [0, 2e9], tier="disk"),
        *series(seconds_total, [0, 1.0], stage="gather", tier="disk"),
        *series(seconds_total, [0, 3.0], stage="write", tier="disk"),
        # 1 GB loaded from disk: 2 s reading, 0.5 s copying into the KV cache
        *series(bytes_total, [0, 1e9], stage="copy", tier="disk"),
        *series(seconds_total, [0, 2.0], stage="read", tier="disk"),
        *series(seconds_total, [0, 0.5], stage="copy", tier="disk"),
    )
    out = views.throughput_by_tier(f, window_s=60)
    assert out["store disk"].iloc[-1] == pytest.approx(2e9 / 4.0)
    assert out["load disk"].iloc[-1] == pytest.approx(1e9 / 2.5)
