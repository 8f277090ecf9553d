"""What-if tier sizing: the sampled curve against an exact LRU simulation of the same trace."""

from __future__ import annotations

import threading
import time

import pytest

from connector.engine.whatif import DEFAULT_FACTORS, HitRatioCurve, WhatIfTracker, sizing_advice
from tests.unit.whatif_traces import (
    CHUNK,
    exact_lru_curve,
    exact_lru_hit_ratio,
    exact_lru_hits,
    loop_trace,
    shared_prefix_trace,
    shifting_trace,
    zipf_trace,
)

CAP = 3000 * CHUNK  # the tier's budget: 16x covers 48,000 chunks, so 8,192 samples mean R < 1
N = 200_000


def replay(trace, **kw) -> HitRatioCurve:
    est = HitRatioCurve(kw.pop("capacity", CAP), **{"half_life": None, **kw})
    for item in trace:
        if len(item) == 3 and not item[2]:
            est.store(item[0], item[1])
        else:
            est.access(item[0], item[1])
    return est


def exact_curve(trace, capacity=CAP) -> dict[float, float]:
    ratios = exact_lru_curve(trace, [capacity * f for f in DEFAULT_FACTORS])
    return dict(zip(DEFAULT_FACTORS, ratios, strict=True))


def test_the_one_pass_oracle_is_an_lru_simulation_at_every_size():
    trace = shared_prefix_trace(12_000, prefixes=40)
    for f in DEFAULT_FACTORS:
        assert exact_curve(trace, 100 * CHUNK)[f] == exact_lru_hit_ratio(trace, 100 * CHUNK * f)


TRACES = {
    "zipf-0.7": lambda: zipf_trace(N, 200_000, 0.7),
    "zipf-1.2": lambda: zipf_trace(N, 200_000, 1.2),
    "loop-12x": lambda: loop_trace(N, 6000),  # ~36,000 chunks, 12 times the tier
    "shared-prefix": lambda: shared_prefix_trace(N),
    "shifting": lambda: shifting_trace(N, 30_000),
}


@pytest.fixture(scope="module", params=sorted(TRACES))
def replayed(request):
    trace = TRACES[request.param]()
    return request.param, trace, exact_curve(trace)


def worst_error(est: HitRatioCurve, exact: dict[float, float]) -> float:
    curve = est.curve()
    return max(abs(curve[f] - exact[f]) for f in DEFAULT_FACTORS)


def test_estimate_is_within_five_points_of_exact_lru_at_every_size(replayed):
    name, trace, exact = replayed
    assert len(trace) >= N
    est = HitRatioCurve(CAP)  # default settings: 8,192 samples, a window of 2**20 references
    for item in trace:
        (est.access if len(item) == 2 else est.store)(item[0], item[1])
    assert est.rate < 0.5, f"{name}: the test must exercise sampling"
    print(name, f"rate {est.rate:.3f}", f"worst error {worst_error(est, exact):.4f}")
    assert worst_error(est, exact) <= 0.05, (name, est.curve(), exact)
    assert max(exact.values()) - min(exact.values()) > 0.15  # a curve with a shape, not a flat line


def test_without_sampling_the_estimate_is_the_exact_lru_simulation():
    trace = zipf_trace(40_000, 3000, 0.9)
    est = replay(trace, capacity=300 * CHUNK)
    assert est.rate == 1.0 and est.accesses == sum(1 for t in trace if len(t) == 2)
    exact = exact_curve(trace, 300 * CHUNK)
    assert est.curve() == pytest.approx(exact, abs=1e-12)


def test_the_window_decays_so_the_curve_follows_a_new_working_set():
    old = loop_trace(20_000, 1000)  # a scan far larger than the tier: no hits
    new = zipf_trace(20_000, 50, 1.0, seed=9)  # a small hot set: hits at every size
    trace = old + new
    cumulative = replay(trace, capacity=100 * CHUNK).curve()
    windowed = replay(trace, capacity=100 * CHUNK, half_life=2000).curve()
    alone = exact_curve(new, 100 * CHUNK)  # as if the scan had never happened
    assert cumulative[4.0] < 0.5 and windowed[4.0] > 0.95
    assert all(abs(windowed[f] - alone[f]) < 0.03 for f in DEFAULT_FACTORS)


def test_decayed_weights_match_an_exactly_weighted_simulation():
    trace = zipf_trace(20_000, 2000, 0.8, seed=5)
    half_life = 2500
    est = replay(trace, capacity=100 * CHUNK, half_life=half_life)
    growth = 2 ** (1 / half_life)
    for f in (0.25, 1.0, 4.0):
        hits = exact_lru_hits(trace, 100 * CHUNK * f)
        weights = [n * growth**i for i, (n, _) in enumerate(hits)]
        expected = sum(w for w, (_, hit) in zip(weights, hits, strict=True) if hit) / sum(weights)
        assert est.curve()[f] == pytest.approx(expected, rel=1e-9)


def test_memory_stays_bounded_on_a_million_ever_new_chunks():
    est = HitRatioCurve(5000 * CHUNK, half_life=None)  # defaults: 8,192 samples
    rates = []
    for i in range(1_000_000):
        est.access(f"new{i}", CHUNK)
        if i in (500_000, 999_999):
            rates.append(est.rate)
    assert est.tracked <= est.max_samples + 256  # samples plus at most every heavy-hitter slot
    assert len(est._by_hash) <= 2 * est.tracked + 64 and len(est._hot) <= 256
    assert len(est._tree) == 4 * est.max_samples + 1
    assert rates[1] > 0.5 * rates[0]  # the rate settles instead of falling forever
    assert est.curve()[16.0] == 0.0


def test_same_seed_same_curve_other_seed_other_sample():
    trace = zipf_trace(30_000, 20_000, 1.0, seed=4)
    a, b, c = (replay(trace, capacity=200 * CHUNK, max_samples=1024, seed=s) for s in (7, 7, 8))
    assert a.rate < 1.0
    assert a.curve() == b.curve() and a.sampled == b.sampled
    assert a.curve() != c.curve()


def test_stores_take_room_but_are_not_counted():
    est = HitRatioCurve(4 * CHUNK, half_life=None)
    est.access("a", CHUNK)
    for i in range(4):
        est.store(f"out{i}", CHUNK)  # four output chunks push "a" out of a 4-chunk tier
    est.access("a", CHUNK)
    curve = est.curve()
    assert est.accesses == 2
    assert curve[1.0] == 0.0 and curve[2.0] == 0.5  # 8 chunks would have kept it
    trace = [("a", CHUNK)] + [(f"out{i}", CHUNK, False) for i in range(4)] + [("a", CHUNK)]
    assert exact_lru_hit_ratio(trace, 4 * CHUNK) == 0.0 and exact_lru_hit_ratio(trace, 8 * CHUNK) == 0.5


def test_hit_ratio_is_weighted_by_bytes():
    trace = [("big", 3 * CHUNK), ("tail", CHUNK // 4), ("tail", CHUNK // 4), ("big", 3 * CHUNK)]
    est = replay(trace, capacity=3 * CHUNK)
    # 3 chunks keep the tail's second reference (one hit in four, a quarter chunk in 6.5);
    # 6 chunks keep the big one too (3 + 0.25 chunks beside it)
    assert est.curve()[1.0] == pytest.approx(0.25 / 6.5) == exact_lru_hit_ratio(trace, 3 * CHUNK)
    assert est.curve()[2.0] == pytest.approx(3.25 / 6.5) == exact_lru_hit_ratio(trace, 6 * CHUNK)


def test_curve_is_empty_before_any_lookup_and_readable_while_fed():
    est = HitRatioCurve(100 * CHUNK)
    assert est.curve() == {}
    seen: list[dict[float, float]] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            seen.append(est.curve())

    t = threading.Thread(target=reader)
    t.start()
    for item in zipf_trace(20_000, 500, 1.0, seed=6):
        est.access(item[0], item[1])
    stop.set()
    t.join()
    for curve in seen:
        values = [curve[f] for f in sorted(curve)]
        assert values == sorted(values) and all(0.0 <= v <= 1.0 for v in values)


def test_bad_arguments_are_refused():
    for kw in ({"capacity_bytes": 0}, {"factors": (0.0, 1.0)}, {"max_samples": 0}, {"half_life": 0}):
        with pytest.raises(ValueError):
            HitRatioCurve(**{"capacity_bytes": CAP, **kw})


CURVE = {0.125: 0.10, 0.25: 0.20, 0.5: 0.30, 1.0: 0.41, 2.0: 0.63, 4.0: 0.70, 8.0: 0.72, 16.0: 0.725}


def test_advice_names_what_doubling_buys():
    assert sizing_advice(CURVE, "cpu") == "doubling the CPU tier would raise the hit rate from 41% to 63%"


def test_advice_says_when_a_tier_is_larger_than_needed():
    flat = {0.25: 0.5, 0.5: 0.694, 1.0: 0.70, 2.0: 0.705, 4.0: 0.705}
    assert sizing_advice(flat, "disk") == (
        "halving the disk tier would cost only 1 point: it is larger than this workload needs"
    )


def test_advice_points_to_the_size_that_would_help_when_doubling_does_not():
    step = {0.5: 0.30, 1.0: 0.41, 2.0: 0.415, 4.0: 0.60, 8.0: 0.61}
    assert sizing_advice(step, "remote") == (
        "the remote tier would need 4x its size to raise the hit rate from 41% to 60%"
    )


def test_advice_when_neither_direction_pays():
    knee = {0.5: 0.30, 1.0: 0.41, 2.0: 0.415, 4.0: 0.42}
    assert sizing_advice(knee, "cpu") == (
        "the CPU tier fits this workload: 41% hit rate, halving it would cost 11 points, "
        "and no size up to 4x would add 2 points"
    )


def feed(tracker: WhatIfTracker, trace, tiers: tuple[str | None, ...] = ("cpu",)) -> None:
    for item in trace:
        for tier in tiers:
            if len(item) == 2:
                tracker.record(tier, item[0].encode(), item[1])
            else:
                tracker.record_store(tier, item[0].encode(), item[1])
        if tracker.pending > 50_000:
            tracker.drain()
    tracker.drain()


def test_tracker_advises_doubling_a_tier_a_loop_outgrows():
    trace = loop_trace(60_000, 300)  # ~1,800 chunks in a loop: twice a 1,000-chunk tier
    tracker = WhatIfTracker({"cpu": 1000 * CHUNK, "disk": 4000 * CHUNK})
    feed(tracker, trace, ("cpu", "disk"))
    line = tracker.advice("cpu")
    assert line is not None and line.startswith("doubling the CPU tier would raise the hit rate from 0% to 9")
    assert tracker.advice("disk") == (  # 2,000 chunks would still hold the whole loop
        "halving the disk tier would cost less than 1 point: it is larger than this workload needs"
    )
    snap = tracker.snapshot()
    assert snap["cpu"] == tracker.curves["cpu"].curve() and set(snap) == {"cpu", "disk"}
    exact = exact_curve(trace, 1000 * CHUNK)
    assert all(abs(snap["cpu"][f] - exact[f]) <= 0.05 for f in DEFAULT_FACTORS)


def test_tracker_says_nothing_without_evidence():
    tracker = WhatIfTracker({"cpu": 100 * CHUNK}, min_references=10_000)
    assert tracker.advice("cpu") is None and tracker.snapshot() == {"cpu": {}}
    feed(tracker, zipf_trace(5_000, 100, 1.0))
    assert tracker.advice("cpu") is None and tracker.advice("remote") is None
    feed(tracker, zipf_trace(10_000, 100, 1.0))
    assert tracker.advice("cpu") is not None


def test_tracker_never_blocks_and_counts_what_it_drops():
    tracker = WhatIfTracker({"cpu": 100 * CHUNK}, buffer_size=1000)
    with tracker._drain_lock:  # a feeder stuck mid-drain must not stall the step loop
        for i in range(5000):
            tracker.record("cpu", b"k%d" % i, CHUNK)
        tracker.record_store("cpu", b"out", CHUNK)
    assert tracker.pending == 1000 and tracker.dropped == 4001
    assert tracker.drain(limit=10) == 10
    tracker.record("gpu", b"x", CHUNK)  # room again; a tier without a curve is counted, not fed
    assert tracker.drain() == 991 and tracker.pending == 0
    assert tracker.processed == 1001 and tracker.unknown_tier == 1 and tracker.dropped == 4001
    assert tracker.curves["cpu"].accesses == 1000


def test_tracker_thread_feeds_the_curves():
    tracker = WhatIfTracker({"cpu": 200 * CHUNK}, half_life=None)
    tracker.start(share=1.0)
    try:
        trace = zipf_trace(20_000, 500, 1.0, seed=8)
        for item in trace:
            tracker.record("cpu", item[0], item[1])
        deadline = time.monotonic() + 10
        while tracker.pending and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        tracker.close()
    assert tracker.pending == 0 and tracker.processed == len(trace) and tracker.dropped == 0
    counted = [(name, nbytes) for name, nbytes, *_ in trace]
    exact = exact_curve(counted, 200 * CHUNK)
    assert tracker.snapshot()["cpu"] == pytest.approx(exact, abs=1e-9)  # 500 docs: nothing sampled


def test_one_record_for_every_tier_feeds_each_curve_alike():
    trace = zipf_trace(20_000, 300, 0.9, seed=12)
    each = WhatIfTracker({"cpu": 50 * CHUNK, "disk": 400 * CHUNK})
    every = WhatIfTracker({"cpu": 50 * CHUNK, "disk": 400 * CHUNK})
    feed(each, trace, ("cpu", "disk"))
    feed(every, trace, (None,))
    assert every.snapshot() == each.snapshot() and every.processed * 2 == each.processed
    assert every.snapshot()["cpu"][1.0] < every.snapshot()["disk"][1.0]
