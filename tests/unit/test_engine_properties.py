"""Property-based tests of the pure engine logic: the tier index with its pins, and chunk keys.

The index is driven by random sequences of the calls the scheduler makes (admit, add_known then
overflow_victims, touch, pin and release per request, forget, clear) next to a model of what it
should hold; the keys by random prompts, extensions and namespaces.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from connector.engine.index import PinTable, TierIndex
from connector.engine.keys import Namespace, PrefixHasher, block_aligned_keys, chain, chunk_keys

PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

KEYS = st.sampled_from("abc")
SIZES = st.integers(0, 150)
REQUESTS = st.sampled_from(["r1", "r2"])


class IndexMachine(RuleBasedStateMachine):
    """A TierIndex and a PinTable next to a model: what is stored, at which size, pinned by whom.

    A request's pin belongs to the chunk it pinned: once that chunk is forgotten (a failed
    load, another engine deleted the file) and stored again, the old pin says nothing about
    the new chunk. Every key that leaves, however, is reported once (the tail directory
    mirrors the index through that report).
    """

    @initialize(capacity=st.integers(0, 400))
    def start(self, capacity: int) -> None:
        self.reported: set[str] = set()  # keys held, as the drop reports tell it
        self.index = TierIndex("cpu", capacity, on_drop=self.reported.remove)
        self.pins = PinTable()
        self.sizes: dict[str, int] = {}  # model: key -> bytes
        self.generation: dict[str, int] = {}  # model: key -> which admission of that key is held
        self.next_generation = 0
        self.held: dict[str, list[tuple[str, int]]] = {}  # model: request -> pinned (key, generation)

    # ---- the model ---------------------------------------------------------------------
    def _store(self, key: str, nbytes: int) -> None:
        self.reported.add(key)
        self.sizes[key] = nbytes
        self.next_generation += 1
        self.generation[key] = self.next_generation

    def _drop(self, key: str) -> None:
        del self.sizes[key], self.generation[key]

    def _pinned(self) -> set[str]:
        return {k for held in self.held.values() for k, g in held if self.generation.get(k) == g}

    def _check_victims(self, victims: list[str]) -> None:
        assert not set(victims) & self._pinned(), f"evicted pinned chunks {set(victims) & self._pinned()}"
        assert len(set(victims)) == len(victims)
        for k in victims:
            assert k in self.sizes, f"evicted {k!r}, which was not stored"
            self._drop(k)

    # ---- the calls the scheduler makes -------------------------------------------------
    @rule(key=KEYS, nbytes=SIZES)
    def admit(self, key: str, nbytes: int) -> None:
        pinned_bytes = sum(self.sizes[k] for k in self._pinned())
        victims = self.index.admit(key, nbytes)
        if key in self.sizes:
            assert victims == []
            return
        if victims is None:  # refused: only when even evicting every unpinned chunk leaves no room
            assert nbytes > self.index.capacity_bytes - pinned_bytes
            return
        self._check_victims(victims)
        self._store(key, nbytes)

    @rule(key=KEYS, nbytes=SIZES, most_recent=st.booleans())
    def another_engine_stored(self, key: str, nbytes: int, most_recent: bool) -> None:
        self.index.add_known(key, nbytes, most_recent)
        if key not in self.sizes:
            self._store(key, nbytes)
        self._check_victims(self.index.overflow_victims())

    @rule(key=KEYS)
    def touch(self, key: str) -> None:
        self.index.touch(key)

    @rule(request=REQUESTS, keys=st.lists(KEYS, max_size=4))
    def pin(self, request: str, keys: list[str]) -> None:
        self.pins.pin(request, [(self.index, k) for k in keys])
        held = [(k, self.generation[k]) for k in keys if k in self.sizes]
        self.held.pop(request, None)
        if held:
            self.held[request] = held

    @rule(request=REQUESTS)
    def release(self, request: str) -> None:
        assert self.pins.release(request) == len(self.held.pop(request, []))
        assert self.pins.release(request) == 0  # idempotent

    @rule(key=KEYS)
    def forget(self, key: str) -> None:
        assert self.index.remove(key) == (key in self.sizes)
        if key in self.sizes:
            self._drop(key)

    @precondition(lambda self: self.sizes)
    @rule(data=st.data())
    def forget_then_store_again(self, data: st.DataObject) -> None:
        """A chunk dropped after a failed load, then saved again by a later request."""
        key = data.draw(st.sampled_from(sorted(self.sizes)))
        self.forget(key)
        self.admit(key, data.draw(SIZES))

    @precondition(lambda self: self.sizes)
    @rule()
    def clear(self) -> None:
        self._check_victims(self.index.clear())
        assert set(self.sizes) == self._pinned()

    # ---- what always holds ---------------------------------------------------------------
    @invariant()
    def within_capacity(self) -> None:
        assert self.index.used_bytes <= self.index.capacity_bytes

    @invariant()
    def accounting_matches_the_chunks_held(self) -> None:
        assert set(self.index.keys()) == set(self.sizes) == self.reported and len(self.index) == len(
            self.sizes
        )
        assert self.index.used_bytes == sum(self.sizes.values())
        pinned = self._pinned()
        assert self.index.pinned_keys == len(pinned)
        assert self.index.pinned_bytes == sum(self.sizes[k] for k in pinned)
        assert set(self.pins.requests()) == set(self.held)


IndexMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_tier_index_under_random_calls = IndexMachine.TestCase


# ---- chunk keys -----------------------------------------------------------------------
tokens = st.lists(st.integers(0, 2**31) | st.integers(2**32 - 2, 2**40), max_size=40)  # 4- and 8-byte ids
chunk_sizes = st.integers(1, 8)
names = st.text(alphabet="ab=", max_size=3)  # "=" separates a tag's name from its value
namespaces = st.builds(
    Namespace,
    st.sampled_from(["m1", "m2"]),
    st.sampled_from(["bf16", "fp16"]),
    st.sampled_from(["L1", "L2"]),
    st.integers(1, 2),
    st.none() | names,
    st.none() | names,
    st.dictionaries(names, names, max_size=2).map(lambda tags: tuple(sorted(tags.items()))),
)


@PROPERTY
@given(namespaces, tokens, tokens, chunk_sizes, st.booleans())
def test_keys_of_a_prompt_are_a_prefix_of_the_keys_of_its_extensions(ns, prompt, extension, size, partial):
    keys = chunk_keys(ns, prompt, size, partial)
    assert keys == chunk_keys(ns, list(prompt), size, partial)  # deterministic
    longer = chunk_keys(ns, prompt + extension, size, partial)
    full = len(prompt) // size
    assert keys[:full] == longer[:full]
    assert [(k.start, k.num_tokens) for k in keys] == [
        (s, min(size, len(prompt) - s))
        for s in range(0, len(prompt), size)
        if partial or s + size <= len(prompt)
    ]


@PROPERTY
@given(namespaces, tokens, tokens, chunk_sizes, st.booleans(), st.integers(0, 50))
def test_incremental_hashing_gives_the_same_keys(ns, prompt, extension, size, partial, upto):
    hasher = PrefixHasher(ns, size)
    assert hasher.keys(prompt, partial) == chunk_keys(ns, prompt, size, partial)
    grown = prompt + extension
    assert hasher.keys(grown, partial, upto) == chunk_keys(ns, grown[:upto], size, partial)
    assert hasher.keys(grown, partial) == chunk_keys(ns, grown, size, partial)


@PROPERTY
@given(tokens, st.integers(1, 4), st.integers(1, 4))
def test_block_aligned_keys_hash_each_whole_block_prefix_on_its_own(chunk, block, blocks_per_chunk):
    parent, size = bytes(16), block * blocks_per_chunk
    lengths = range(min(len(chunk), size - 1) // block * block, 0, -block)
    keys = block_aligned_keys(parent, chunk, 7, size, block)
    assert [(k.start, k.num_tokens) for k in keys] == [(7, n) for n in lengths]
    assert [k.digest for k in keys] == [chain(parent, chunk[:n]) for n in lengths]


@PROPERTY
@given(namespaces, namespaces, tokens.filter(bool), chunk_sizes)
def test_a_different_namespace_shares_no_key(ns1, ns2, prompt, size):
    a = {k.digest for k in chunk_keys(ns1, prompt, size, True)}
    b = {k.digest for k in chunk_keys(ns2, prompt, size, True)}
    same = (
        ns1.model,
        ns1.dtype,
        ns1.kv_layout,
        ns1.world_size,
        ns1.lora or "",
        ns1.cache_salt or "",
        ns1.tags,
    ) == (
        ns2.model,
        ns2.dtype,
        ns2.kv_layout,
        ns2.world_size,
        ns2.lora or "",
        ns2.cache_salt or "",
        ns2.tags,
    )  # no LoRA / no salt and an empty name are the same thing
    assert (a == b) if same else not (a & b)


tag_texts = st.sampled_from(["", "a", "=", "a=", "=a", "b"])  # texts that join ambiguously around "="
tag_sets = st.dictionaries(tag_texts, tag_texts, max_size=2)


@PROPERTY
@given(namespaces, tag_sets, tag_sets)
def test_requests_with_different_tags_share_no_key(ns, tags1, tags2):
    prompt = [1, 2, 3]
    a = chunk_keys(ns.with_request(ns.lora, ns.cache_salt, tags1), prompt, 2, True)
    b = chunk_keys(ns.with_request(ns.lora, ns.cache_salt, tags2), prompt, 2, True)
    assert (a == b) == (tags1 == tags2)


@PROPERTY
@given(namespaces, st.text(alphabet="ab=", max_size=8))
def test_a_tag_name_and_value_are_not_read_as_one_text(ns, text):
    """Every way to split ``text`` at an "=" into a tag name and value is its own namespace."""
    splits = [(text[:i], text[i + 1 :]) for i, c in enumerate(text) if c == "="]
    digests = {chunk_keys(ns.with_request(None, None, {k: v}), [7], 1, True)[0].digest for k, v in splits}
    assert len(digests) == len(splits)
