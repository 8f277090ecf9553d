"""Chunk reference traces shaped like a KV tier's: prompts of whole chunks plus a shorter tail,
shared system prompts, stores of output chunks nobody reads again. Used by the what-if tests and
``bench/whatif.py``; every trace is a pure function of its seed.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence

CHUNK = 1 << 20  # bytes of a whole chunk
TraceItem = tuple[str, int] | tuple[str, int, bool]  # (name, nbytes[, counted])


def _document(doc: int, rng: random.Random, systems: int) -> list[tuple[str, int]]:
    """A prompt's chunks: a shared system-prompt chunk, 1-7 own chunks, a shorter tail."""
    chunks = [(f"sys{doc % systems}", CHUNK)]
    chunks += [(f"d{doc}c{i}", CHUNK) for i in range(rng.randint(1, 7))]
    chunks.append((f"d{doc}t", rng.randint(CHUNK // 16, CHUNK - 1)))
    return chunks


class _Zipf:
    def __init__(self, n: int, alpha: float, rng: random.Random) -> None:
        self._cum = list(itertools.accumulate(1.0 / (k + 1) ** alpha for k in range(n)))
        self._rng = rng

    def draw(self) -> int:
        return bisect.bisect_left(self._cum, self._rng.random() * self._cum[-1])


def _requests(draw, docs: dict, rng: random.Random, n: int, systems: int, outputs: float):
    trace: list[TraceItem] = []
    out_id = 0
    while len(trace) < n:
        doc = draw()
        if doc not in docs:
            docs[doc] = _document(doc, rng, systems)
        trace.extend(docs[doc])
        if rng.random() < outputs:  # the answer's chunk is stored, and never asked for again
            out_id += 1
            trace.append((f"out{out_id}", CHUNK, False))
    return trace


def zipf_trace(n: int, docs: int, alpha: float, seed: int = 1, systems: int = 20) -> list[TraceItem]:
    rng = random.Random(seed)
    zipf = _Zipf(docs, alpha, rng)
    perm = list(range(docs))
    rng.shuffle(perm)
    return _requests(lambda: perm[zipf.draw()], {}, rng, n, systems, outputs=0.3)


def loop_trace(n: int, docs: int, seed: int = 2) -> list[TraceItem]:
    """The same documents in the same order, over and over: LRU's worst case below the loop's size."""
    rng = random.Random(seed)
    order = itertools.cycle(range(docs))
    return _requests(lambda: next(order), {}, rng, n, systems=docs, outputs=0.0)


def shifting_trace(n: int, docs: int, seed: int = 3) -> list[TraceItem]:
    """Working sets that change: Zipf phases over different document ranges, a scan between."""
    rng = random.Random(seed)
    trace: list[TraceItem] = []
    phase = -(-2 * n // 9)  # four phases and half a phase of scan: at least n references
    store: dict = {}
    for k, (alpha, base) in enumerate([(0.8, 0), (1.1, docs), (0.6, 2 * docs), (1.0, 0)]):
        zipf = _Zipf(docs, alpha, rng)
        trace += _requests(lambda b=base, z=zipf: b + z.draw(), store, rng, phase, 20, 0.2)
        if k == 1:
            scan = iter(range(10 * docs, 10 * docs + 10**9))
            trace += _requests(lambda s=scan: next(s), store, rng, phase // 2, 20, 0.0)
    return trace


def mean_chunk_bytes(trace: list[TraceItem]) -> float:
    return sum(item[1] for item in trace) / len(trace)


def exact_lru_hits(trace: Iterable[TraceItem], capacity_bytes: float) -> list[tuple[int, bool]]:
    """Simulate an LRU cache of ``capacity_bytes``: (nbytes, hit) for each counted reference.

    Every item, counted or not, brings its chunk in as the most recent, evicting the least
    recent until the bytes fit; a chunk larger than the cache empties it (the stack model's
    view: real tiers refuse such a chunk, but chunks are far smaller than tiers).
    """
    cache: OrderedDict[str, int] = OrderedDict()
    used = 0
    out: list[tuple[int, bool]] = []
    for item in trace:
        name, nbytes = item[0], item[1]
        counted = item[2] if len(item) > 2 else True  # type: ignore[misc]
        old = cache.pop(name, None)
        if counted:
            out.append((nbytes, old is not None))
        used += nbytes - (old or 0)
        cache[name] = nbytes
        while used > capacity_bytes:
            used -= cache.popitem(last=False)[1]
    return out


def exact_lru_hit_ratio(trace: Iterable[TraceItem], capacity_bytes: float) -> float:
    """Byte-weighted hit ratio of an LRU cache of ``capacity_bytes`` over ``trace``."""
    results = exact_lru_hits(trace, capacity_bytes)
    total = sum(n for n, _ in results)
    return sum(n for n, hit in results if hit) / total if total else 0.0


def exact_lru_curve(trace: Sequence[TraceItem], capacities: Sequence[float]) -> list[float]:
    """Byte hit ratios of LRU caches of each capacity in one pass (checked against
    ``exact_lru_hits``): a reference hits when the bytes of the distinct chunks referenced since
    its previous reference, plus its own, fit; a Fenwick tree over positions sums them."""
    n = len(trace)
    tree = [0] * (n + 1)
    last: dict[str, tuple[int, int]] = {}
    hits = [0] * len(capacities)
    total = stored = 0
    for i, item in enumerate(trace, 1):
        name, nbytes = item[0], item[1]
        counted = item[2] if len(item) > 2 else True  # type: ignore[misc]
        prev = last.get(name)
        if prev is not None:
            j, old = prev
            since = stored
            while j:  # stored bytes at or before the previous reference
                since -= tree[j]
                j &= j - 1
            j = prev[0]
            while j <= n:
                tree[j] -= old
                j += j & -j
            stored -= old
            if counted:
                for k, cap in enumerate(capacities):
                    if since + nbytes <= cap:
                        hits[k] += nbytes
        if counted:
            total += nbytes
        j = i
        while j <= n:
            tree[j] += nbytes
            j += j & -j
        stored += nbytes
        last[name] = (i, nbytes)
    return [h / total if total else 0.0 for h in hits]


def shared_prefix_trace(n: int, prefixes: int = 200, seed: int = 4) -> list[TraceItem]:
    """Few-shot prompts: a Zipf-popular shared prefix of 4-12 chunks, then 1-4 chunks of the
    user's own that are never asked for again, then maybe an output chunk."""
    rng = random.Random(seed)
    zipf = _Zipf(prefixes, 0.9, rng)
    heads = [[(f"p{p}c{i}", CHUNK) for i in range(rng.randint(4, 12))] for p in range(prefixes)]
    trace: list[TraceItem] = []
    user = 0
    while len(trace) < n:
        trace.extend(heads[zipf.draw()])
        user += 1
        trace.extend((f"u{user}c{i}", CHUNK) for i in range(rng.randint(1, 4)))
        trace.append((f"u{user}t", rng.randint(CHUNK // 16, CHUNK - 1)))
        if rng.random() < 0.3:
            trace.append((f"u{user}out", CHUNK, False))
    return trace
