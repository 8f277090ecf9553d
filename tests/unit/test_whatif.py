"""What-if tier sizing: the sampled curve against an exact LRU simulation of the same trace."""

from __future__ import annotations

import threading

import pytest

from connector.engine.whatif import DEFAULT_FACTORS, HitRatioCurve
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
    trace = shared_prefix_trace(30_000, prefixes=60)
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
    old = loop_trace(30_000, 1500)  # a scan far larger than the tier: no hits
    new = zipf_trace(30_000, 50, 1.0, seed=9)  # a small hot set: hits at every size
    trace = old + new
    cumulative = replay(trace, capacity=100 * CHUNK).curve()
    windowed = replay(trace, capacity=100 * CHUNK, half_life=3000).curve()
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


def test_memory_stays_bounded_on_a_stream_of_new_prompts():
    est = HitRatioCurve(50 * CHUNK, max_samples=512, half_life=None)
    rates = []
    for i in range(200_000):
        est.access(f"new{i}", CHUNK)
        if i in (100_000, 199_999):
            rates.append(est.rate)
    assert est.tracked <= 512 + 256
    assert len(est._by_hash) <= 2 * est.tracked + 64 and len(est._hot) <= 256
    assert len(est._tree) == 4 * 512 + 1
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
