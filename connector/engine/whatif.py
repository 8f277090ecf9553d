"""What-if tier sizing: the hit rate each tier would have at other sizes, estimated live.

A tier is an LRU cache with a byte budget. For LRU, one pass over the references gives the
hit ratio at *every* size: a reference to chunk ``x`` hits in a cache of ``C`` bytes exactly
when the bytes of the distinct chunks referenced since ``x``'s previous reference, plus ``x``
itself, fit in ``C`` (its byte-weighted stack distance). The tests hold this to agree exactly
with a simulated LRU cache when nothing is sampled.

Tracking every chunk would cost memory in proportion to the store, so ``HitRatioCurve``
follows SHARDS (Waldspurger et al., FAST '15): only chunks whose seeded 64-bit hash falls
below a threshold ``T`` are tracked (rate ``R = T / 2**64``), and the bytes between two
references of a sampled chunk, counted among sampled chunks only, are scaled by ``1 / R``
(the chunk's own bytes are not: they are known exactly). The threshold adapts so that at most
``max_samples`` chunks are tracked: when a new chunk would pass the bound, the tracked chunk
with the largest hash is dropped and its hash becomes the new threshold. Before lowering the
rate, chunks whose next reference would miss even at the largest size asked about are
forgotten (a later reference is then a cold miss, which is what it would be anyway), so the
rate settles where ``max_samples`` chunks cover the largest size instead of falling forever on
a stream of ever-new prompts. Each sampled reference stands for ``nbytes / R`` (the rate in
force when it was seen).

Spatial sampling's error comes mostly from a few hot chunks (a shared system prompt, a popular
document) being in or out of the sample. So the heavy hitters are found with Misra-Gries
counters (256 slots: every chunk with more than 1/256 of the references is found) and tracked
exactly, whatever their hash, standing for their own bytes; the bytes between two references
are then exact bytes plus sampled bytes over ``R``. At the default 8,192 samples, on the
tests' traces of 200,000 references (``R`` from 0.15 to 0.25), the curve stays within 1.5 points
of an exact LRU simulation at every size.

Hit ratios are byte-weighted: a chunk's bytes are proportional to its tokens, so this is the
token hit rate the dashboards show. They are taken over a decaying window of references
(``half_life`` references; ``None`` keeps everything since start), because a sizing answer
must follow the workload a tier serves now, and counting references rather than seconds keeps
the evidence when the engine idles and makes the estimate a pure function of the stream.

``WhatIfTracker`` keeps this work off the scheduler's step loop: the loop only appends to a
bounded buffer, and a throttled daemon thread feeds the curves.
"""

from __future__ import annotations

import heapq
import threading
import time
from bisect import bisect_left
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping

from xxhash import xxh3_64_intdigest

DEFAULT_FACTORS = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
DEFAULT_HALF_LIFE = 1 << 20  # references
_SPACE = 1 << 64  # hash space: the sampling rate is threshold / _SPACE
_RENORMALIZE = 1e100  # decayed weights grow; rescale them before they overflow
_HOT_SLOTS = 256  # Misra-Gries counters: finds every chunk with more than 1/256 of the references
_PROMOTE = 16  # a chunk counted this often is tracked exactly
_COLD, _HOT, _PROMOTED = 0, 1, 2

Key = str | bytes  # a chunk's name: its hex digest or the digest itself


class HitRatioCurve:
    """Estimated LRU hit ratio of one tier at ``factors`` times its byte budget.

    ``access`` and ``store`` come from one thread (the consumer of a queue of the scheduler's
    references); ``curve`` may be called from any thread. A lock held for a few microseconds
    per reference keeps ``curve`` from seeing half an update.
    """

    def __init__(
        self,
        capacity_bytes: int,
        factors: Iterable[float] = DEFAULT_FACTORS,
        max_samples: int = 8192,
        seed: int = 0,
        half_life: float | None = DEFAULT_HALF_LIFE,
    ) -> None:
        self._factors = tuple(sorted(set(factors)))
        if capacity_bytes <= 0 or not self._factors or self._factors[0] <= 0:
            raise ValueError("capacity_bytes and every factor must be positive")
        if max_samples < 1 or (half_life is not None and half_life <= 0):
            raise ValueError("max_samples and half_life must be positive")
        self.capacity_bytes = capacity_bytes
        self.max_samples = max_samples
        self._caps = [capacity_bytes * f for f in self._factors]
        self._seed = seed
        self._threshold = _SPACE
        # name -> (stamp, nbytes, hash, value in the tree); in recency order, so stamps ascend
        self._keys: OrderedDict[Key, tuple[int, int, int, complex]] = OrderedDict()
        self._by_hash: list[tuple[int, Key]] = []  # max-heap (negated hash), lazily pruned
        self._hot: dict[Key, int] = {}  # Misra-Gries counts
        self._exact: set[Key] = set()  # heavy hitters: tracked whatever their hash, weight 1
        self._size = max(4 * max_samples, 1024)
        # Fenwick tree over stamps of the bytes each tracked chunk had at its last reference; a
        # complex value carries both strata in one walk: real = sampled bytes, imaginary = exact.
        self._tree = [0j] * (self._size + 1)
        self._clock = 0
        self._tracked = 0j
        self._buckets = [0.0] * (len(self._caps) + 1)  # weight that first hits at caps[i]; last: misses
        self._sampled_bytes = 0.0  # what the tracked references stand for, decayed
        self._weight = 1.0
        self._growth = 1.0 if half_life is None else 2.0 ** (1.0 / half_life)
        self._lock = threading.Lock()
        self.accesses = 0
        self.sampled = 0

    @property
    def factors(self) -> tuple[float, ...]:
        return self._factors

    @property
    def rate(self) -> float:
        """The current sampling rate R (1.0 until more than ``max_samples`` chunks matter)."""
        return self._threshold / _SPACE

    @property
    def tracked(self) -> int:
        return len(self._keys)

    def access(self, name: Key, nbytes: int) -> None:
        """A lookup needed chunk ``name``: one counted reference, and the chunk becomes the most
        recent (a miss is followed by its store, so a reference brings it in).

        Feed every whole chunk a request needs, in prefix order, including those past its first
        miss: a larger tier might have held them. Feed a chunk once per request.
        """
        h = xxh3_64_intdigest(name if isinstance(name, bytes) else name.encode(), self._seed)
        with self._lock:
            self.accesses += 1
            weight = self._weight
            if self._growth != 1.0:
                self._weight = weight * self._growth
                if self._weight > _RENORMALIZE:
                    self._renormalize()
            heat = self._heat(name)
            if heat == _COLD and h >= self._threshold:
                return
            rate = self._threshold / _SPACE
            others = self._touch(name, nbytes, h)
            if others is None and heat == _PROMOTED and h >= self._threshold:
                return  # hot, but no history yet: not counted
            self.sampled += 1
            stands_for = nbytes * weight / (rate if heat == _COLD else 1.0)
            self._sampled_bytes += stands_for
            if others is None:
                at = len(self._caps)
            else:
                at = bisect_left(self._caps, others.real / rate + others.imag + nbytes)
            self._buckets[at] += stands_for

    def store(self, name: Key, nbytes: int) -> None:
        """Chunk ``name`` was written: it becomes the most recent, but nothing asked for it, so it
        is not counted (an output chunk nobody reads still takes room in an LRU)."""
        h = xxh3_64_intdigest(name if isinstance(name, bytes) else name.encode(), self._seed)
        with self._lock:
            if h < self._threshold or name in self._exact:
                self._touch(name, nbytes, h)

    def curve(self) -> dict[float, float]:
        """Factor -> estimated byte hit ratio over the window; empty before any reference."""
        with self._lock:
            buckets = list(self._buckets)
            total = self._sampled_bytes
        if total <= 0:
            return {}
        out, hits = {}, 0.0
        for factor, weight in zip(self._factors, buckets, strict=False):
            hits += weight
            out[factor] = min(1.0, hits / total)
        return out

    def _renormalize(self) -> None:
        scale = 1.0 / self._weight
        self._buckets = [b * scale for b in self._buckets]
        self._sampled_bytes *= scale
        self._weight = 1.0

    def _heat(self, name: Key) -> int:
        """Count ``name`` among the heavy hitters (Misra-Gries); say whether it is tracked exactly.

        Spatial sampling's error comes mostly from a few hot chunks being in or out of the
        sample; tracking those exactly removes most of it for little memory.
        """
        hot = self._hot
        count = hot.get(name)
        if count is None:
            if len(hot) < _HOT_SLOTS:
                hot[name] = 1
            else:
                self._cool()
            return _COLD
        hot[name] = count + 1
        if name in self._exact:
            return _HOT
        if count + 1 >= _PROMOTE:
            self._exact.add(name)
            return _PROMOTED
        return _COLD

    def _cool(self) -> None:
        """A Misra-Gries round: every count drops by one (amortized O(1): a round takes back as
        many counts as it visits); chunks that leave the counters are sampled again."""
        self._hot = {n: c - 1 for n, c in self._hot.items() if c > 1}
        for name in [n for n in self._exact if n not in self._hot]:
            self._exact.discard(name)
            entry = self._keys.get(name)
            if entry is None:
                continue
            stamp, nbytes, h, value = entry
            if h >= self._threshold:
                self._forget(name)
                continue
            self._add(stamp, nbytes - value)
            self._tracked += nbytes - value
            self._keys[name] = (stamp, nbytes, h, complex(nbytes))
            heapq.heappush(self._by_hash, (-h, name))

    def _touch(self, name: Key, nbytes: int, h: int) -> complex | None:
        """Make ``name`` the most recent; return the bytes referenced since its previous reference
        (real: sampled chunks, imaginary: exact ones), or None when it was not tracked."""
        entry = self._keys.pop(name, None)
        others = None
        if entry is not None:
            stamp, _, _, old = entry
            others = self._tracked - self._prefix(stamp)
            self._add(stamp, -old)
            self._tracked -= old
        elif h < self._threshold:
            heapq.heappush(self._by_hash, (-h, name))
        if self._clock == self._size:
            self._renumber()
        self._clock += 1
        value = nbytes * 1j if name in self._exact else complex(nbytes)
        self._add(self._clock, value)
        self._tracked += value
        self._keys[name] = (self._clock, nbytes, h, value)
        if entry is None:
            self._bound()
        return others

    def _bound(self) -> None:
        """Forget chunks beyond the largest size, then lower the rate while too many are tracked."""
        keys = self._keys
        rate = self._threshold / _SPACE
        while len(keys) > 1:
            name, (_, _, _, value) = next(iter(keys.items()))
            rest = self._tracked - value
            if rest.real / rate + rest.imag <= self._caps[-1]:
                break
            self._forget(name)
        while len(keys) > self.max_samples + len(self._exact) and self._by_hash:
            neg, name = heapq.heappop(self._by_hash)
            entry = keys.get(name)
            if entry is not None and entry[2] == -neg and name not in self._exact:
                self._threshold = -neg
                self._forget(name)
        if len(self._by_hash) > 2 * len(keys) + 64:
            self._by_hash = [(-h, n) for n, (_, _, h, _) in keys.items() if n not in self._exact]
            heapq.heapify(self._by_hash)

    def _forget(self, name: Key) -> None:
        stamp, _, _, value = self._keys.pop(name)
        self._add(stamp, -value)
        self._tracked -= value

    def _prefix(self, i: int) -> complex:
        tree, total = self._tree, 0j
        while i:
            total += tree[i]
            i &= i - 1
        return total

    def _add(self, i: int, delta: complex) -> None:
        tree, size = self._tree, self._size
        while i <= size:
            tree[i] += delta
            i += i & -i

    def _renumber(self) -> None:
        """Stamps ran out: number the tracked chunks 1..n in recency order and rebuild the tree
        in linear time (amortized O(1): it happens once per ``3 * max_samples`` references)."""
        tree = [0j] * (self._size + 1)
        entries = [(name, (i, n, h, v)) for i, (name, (_, n, h, v)) in enumerate(self._keys.items(), 1)]
        for name, entry in entries:
            self._keys[name] = entry
            tree[entry[0]] = entry[3]
        for i in range(1, self._size + 1):
            parent = i + (i & -i)
            if parent <= self._size:
                tree[parent] += tree[i]
        self._tree = tree
        self._clock = len(entries)


_NAMES = {"cpu": "CPU"}
MIN_GAIN_POINTS = 2  # a larger size must buy at least this much to be worth advising


def sizing_advice(curve: Mapping[float, float], tier: str) -> str:
    """One line for an operator from a tier's curve (factor -> hit ratio, 1.0 = as configured).

    Points are differences of the rounded percentages, so the line reads consistently. The
    estimate is good to a few points, so a gain below ``MIN_GAIN_POINTS`` is not advertised.
    """
    label = _NAMES.get(tier, tier)
    pct = {f: round(100 * r) for f, r in curve.items()}
    here = pct[1.0]
    doubled, halved = pct.get(2.0), pct.get(0.5)
    if doubled is not None and doubled - here >= MIN_GAIN_POINTS:
        return f"doubling the {label} tier would raise the hit rate from {here}% to {doubled}%"
    if halved is not None and here - halved <= 1:
        cost = "less than 1 point" if here == halved else "only 1 point"
        return f"halving the {label} tier would cost {cost}: it is larger than this workload needs"
    larger = [f for f in sorted(pct) if f > 2.0 and pct[f] - here >= MIN_GAIN_POINTS]
    if larger:
        f = larger[0]
        return f"the {label} tier would need {f:g}x its size to raise the hit rate from {here}% to {pct[f]}%"
    parts = [f"the {label} tier fits this workload: {here}% hit rate"]
    if halved is not None:
        parts.append(f"halving it would cost {here - halved} points")
    return ", ".join(parts) + f", and no size up to {max(pct):g}x would add {MIN_GAIN_POINTS} points"


class WhatIfTracker:
    """The scheduler's door to one ``HitRatioCurve`` per tier, at O(1) cost on its step loop.

    ``record`` and ``record_store`` append to a bounded buffer and return: when the buffer is
    full the reference is dropped and counted, never waited for. A daemon thread (``start``,
    held to a share of the wall time) or the caller, off its loop (``drain``), feeds the buffer
    to the curves.

    What counts as a reference (``record``), per tier, once per request, in prefix order: each
    whole chunk the lookup found plus the first whole chunk it missed on, and then each prompt
    chunk past that one, when the request stores it (a larger tier might have held it), its stored
    unfull tail included (a repeat of the prompt finds it). Chunks
    written that no lookup asked for (generated tokens) are ``record_store``: they take room but
    are not counted. The missed chunk's own store is not recorded again.
    """

    def __init__(
        self,
        capacities: Mapping[str, int],
        factors: Iterable[float] = DEFAULT_FACTORS,
        max_samples: int = 8192,
        half_life: float | None = DEFAULT_HALF_LIFE,
        buffer_size: int = 1 << 16,
        min_references: int = 10_000,
        seed: int = 0,
    ) -> None:
        if buffer_size < 1:
            raise ValueError("buffer_size must be positive")
        self.curves = {
            tier: HitRatioCurve(cap, factors, max_samples, seed, half_life)
            for tier, cap in capacities.items()
        }
        self.min_references = min_references
        self._buffer: deque[tuple[str | None, Key, int, bool]] = deque()
        self._buffer_size = buffer_size
        self._drain_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.dropped = 0  # written by the recording thread only
        self.processed = 0
        self.unknown_tier = 0

    def record(self, tier: str | None, key: Key, nbytes: int) -> None:
        """A counted reference (see the class docstring); never blocks. ``tier=None`` means
        every tier: KVLens writes each chunk to every usable tier, so one call serves them all."""
        if len(self._buffer) >= self._buffer_size:
            self.dropped += 1
        else:
            self._buffer.append((tier, key, nbytes, True))

    def record_store(self, tier: str | None, key: Key, nbytes: int) -> None:
        """A chunk written that no lookup asked for; never blocks. ``tier=None``: every tier."""
        if len(self._buffer) >= self._buffer_size:
            self.dropped += 1
        else:
            self._buffer.append((tier, key, nbytes, False))

    def drain(self, limit: int | None = None) -> int:
        """Feed up to ``limit`` buffered references (all, if None) to the curves; how many."""
        popleft, curves = self._buffer.popleft, self.curves
        done = 0
        with self._drain_lock:
            while limit is None or done < limit:
                try:
                    tier, key, nbytes, counted = popleft()
                except IndexError:
                    break
                done += 1
                if tier is None:
                    for curve in curves.values():
                        (curve.access if counted else curve.store)(key, nbytes)
                    continue
                curve = curves.get(tier)
                if curve is None:
                    self.unknown_tier += 1
                elif counted:
                    curve.access(key, nbytes)
                else:
                    curve.store(key, nbytes)
            self.processed += done
        return done

    def start(self, share: float = 0.1, batch: int = 64, idle_s: float = 0.05) -> None:
        """Feed the curves from a daemon thread that takes at most ``share`` of the wall time.

        Under the GIL a busy feeder slows the step loop as much as work on it would, so after
        each batch it sleeps long enough to keep its share; the buffer absorbs bursts, and
        what outruns it is dropped and counted.
        """
        if not 0 < share <= 1:
            raise ValueError("share must be in (0, 1]")
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._feed, args=(share, batch, idle_s), name="kvlens-whatif", daemon=True
            )
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _feed(self, share: float, batch: int, idle_s: float) -> None:
        rest = 1.0 / share - 1.0
        while not self._stop.is_set():
            began = time.perf_counter()
            if self.drain(batch):
                time.sleep((time.perf_counter() - began) * rest)  # also hands the GIL back
            else:
                self._stop.wait(idle_s)

    @property
    def pending(self) -> int:
        return len(self._buffer)

    def snapshot(self) -> dict[str, dict[float, float]]:
        """Tier -> factor -> estimated hit ratio (a tier with no references yet has ``{}``)."""
        return {tier: curve.curve() for tier, curve in self.curves.items()}

    def advice(self, tier: str) -> str | None:
        """One line on the tier's size, or None before ``min_references`` references to it."""
        curve = self.curves.get(tier)
        if curve is None or curve.accesses < self.min_references or curve.sampled == 0:
            return None
        points = curve.curve()
        return sizing_advice(points, tier) if 1.0 in points else None
