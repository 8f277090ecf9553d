"""A segment's chunks are keyed by the segment's own tokens, inside the namespace, never as a prefix
chunk; a record's stored position gives the rotation; a plan covers every token once."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from connector.engine.keys import Namespace, chunk_keys
from connector.engine.segment_keys import (
    Computed,
    StoredAt,
    cut_chunks,
    plan_reuse,
    segment_chunks,
    segment_seed,
)
from connector.engine.segments import Segment, cut

NS = Namespace("model", "bfloat16", "bs16:L2")
SEP = (7, 8)
CHUNK = 4


def doc(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(9, 50_000) for _ in range(n)]


def digests_of(tokens, namespace=NS, min_tokens=1):
    return [c.digest for c in cut_chunks(namespace, tokens, cut(tokens, [SEP], min_tokens), CHUNK)]


def test_a_document_has_the_same_keys_behind_any_prompt_and_at_any_position():
    d = doc(1, 10)
    alone = digests_of(d)
    behind = digests_of(doc(2, 5) + list(SEP) + d + list(SEP) + doc(3, 3))
    reordered = digests_of(doc(4, 9) + list(SEP) + doc(5, 6) + list(SEP) + d)
    assert len(alone) == 3  # two whole chunks and a tail of 2
    assert set(alone) <= set(behind) and set(alone) <= set(reordered)


def test_chunks_are_whole_chunks_from_the_segments_first_token_then_the_tail():
    tokens = doc(6, 3) + list(SEP) + doc(7, 10)
    segment = cut(tokens, [SEP], 1).segments[1]
    chunks = segment_chunks(NS, tokens, segment, CHUNK)
    assert [(c.start, c.num_tokens, c.offset, c.segment) for c in chunks] == [
        (5, 4, 0, 1),
        (9, 4, 4, 1),
        (13, 2, 8, 1),
    ]
    assert chunks[-1].end == len(tokens) and chunks[0].key.start == 5


def test_a_segment_of_whole_chunks_has_no_tail_and_a_short_one_only_a_tail():
    exact = segment_chunks(NS, doc(8, 8), Segment(0, 0, 8, True), CHUNK)
    short = segment_chunks(NS, doc(8, 3), Segment(0, 0, 3, True), CHUNK)
    assert [c.num_tokens for c in exact] == [4, 4] and [c.num_tokens for c in short] == [3]


def test_a_longer_document_shares_the_whole_chunks_of_a_shorter_one_it_starts_with_not_its_tail():
    short, longer = doc(9, 6), doc(9, 6) + doc(10, 5)
    a, b = digests_of(short), digests_of(longer)
    assert a[0] == b[0] and a[1] not in b


def test_only_reusable_segments_are_keyed():
    tokens = doc(11, 2) + list(SEP) + doc(12, 8)
    chunks = cut_chunks(NS, tokens, cut(tokens, [SEP], 3), CHUNK)
    assert {c.segment for c in chunks} == {1}


def test_segment_keys_never_meet_prefix_keys_of_the_same_tokens():
    d = doc(13, 12)
    prefix = {k.digest for k in chunk_keys(NS, d, CHUNK, include_partial=True)}
    assert not prefix & set(digests_of(d)) and segment_seed(NS) != NS.seed()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=24), st.integers(1, 5))
def test_no_segment_key_is_a_prefix_key_of_any_prompt_of_the_same_namespace(tokens, chunk_size):
    prefix = {k.digest for k in chunk_keys(NS, tokens, chunk_size, include_partial=True)}
    segment = {c.digest for c in segment_chunks(NS, tokens, Segment(0, 0, len(tokens), True), chunk_size)}
    assert not prefix & segment


def test_every_namespace_part_separates_segment_keys_as_it_separates_prefix_keys():
    d = doc(14, 8)
    base = set(digests_of(d))
    others = [
        Namespace("other-model", "bfloat16", "bs16:L2"),
        Namespace("model", "float16", "bs16:L2"),
        Namespace("model", "bfloat16", "bs16:L4"),
        Namespace("model", "bfloat16", "bs16:L2", world_size=2),
        NS.with_request("lora-digest", None, {}),
        NS.with_request(None, "tenant-salt", {}),
        NS.with_request(None, None, {"user": "a"}),
    ]
    for other in others:
        assert not base & set(digests_of(d, other)), other


def test_the_stored_position_gives_one_rotation_for_the_whole_chunk():
    tokens = doc(15, 20) + list(SEP) + doc(16, 8)
    chunk = cut_chunks(NS, tokens, cut(tokens, [SEP], 1), CHUNK)[-1]
    assert chunk.start == 26
    assert StoredAt(position=4).delta(chunk) == 22
    assert StoredAt(position=26).delta(chunk) == 0
    assert StoredAt(position=40).delta(chunk) == -14


def test_a_plan_loads_stored_chunks_and_says_why_the_rest_is_computed():
    system, d1, d2, question = doc(17, 2), doc(18, 8), doc(19, 6), doc(20, 3)
    tokens = system + list(SEP) + d1 + list(SEP) + d2 + list(SEP) + question
    c = cut(tokens, [SEP], 4)
    chunks = cut_chunks(NS, tokens, c, CHUNK)
    missing = {chunks[1].digest}  # d1's second chunk was evicted
    plan = plan_reuse(c, chunks, lambda d: d not in missing, len(tokens))
    assert [(x.start, x.end) for x in plan.loaded] == [(4, 8), (14, 18), (18, 20)]
    assert plan.computed == (
        (0, 2, Computed.SHORT_SEGMENT),
        (2, 4, Computed.SEPARATOR),
        (8, 12, Computed.NOT_STORED),
        (12, 14, Computed.SEPARATOR),
        (20, 22, Computed.SEPARATOR),
        (22, 25, Computed.SHORT_SEGMENT),
    )
    assert plan.loaded_tokens == 10


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 9), max_size=40),
    st.integers(0, 4),
    st.integers(1, 5),
    st.sets(st.integers(0, 20)),
)
def test_a_plan_covers_every_token_exactly_once(tokens, min_tokens, chunk_size, absent):
    c = cut(tokens, [SEP], min_tokens)
    chunks = cut_chunks(NS, tokens, c, chunk_size)
    gone = {chunks[i].digest for i in absent if i < len(chunks)}
    plan = plan_reuse(c, chunks, lambda d: d not in gone, len(tokens))
    spans = sorted([(x.start, x.end) for x in plan.loaded] + [(a, b) for a, b, _ in plan.computed])
    covered = [t for a, b in spans for t in range(a, b)]
    assert covered == list(range(len(tokens)))
    assert all(x.digest not in gone for x in plan.loaded)
