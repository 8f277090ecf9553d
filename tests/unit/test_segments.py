"""A prompt is cut at the separator's tokens into segments that, with the separators, tile it exactly."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.engine.segments import Segment, cut, find_separators, separator_ids

SEP = (7, 8)


def pieces(tokens, result):
    spans = sorted([(s.start, s.end) for s in result.segments] + list(result.separators))
    return spans, [tokens[a:b] for a, b in spans]


def test_lmcaches_example_prompt_cuts_into_system_documents_and_question():
    system, doc1, doc2, question = [1] * 5, [2] * 300, [3] * 260, [4] * 9
    tokens = system + list(SEP) + doc1 + list(SEP) + doc2 + list(SEP) + question
    result = cut(tokens, [SEP], min_tokens=256)
    assert [(s.start, s.end, s.reusable) for s in result.segments] == [
        (0, 5, False),
        (7, 307, True),
        (309, 569, True),
        (571, 580, False),
    ]
    assert result.separators == ((5, 7), (307, 309), (569, 571))
    assert [s.index for s in result.reusable()] == [1, 2]


def test_a_prompt_without_the_separator_is_one_segment():
    assert cut([1, 2, 3], [SEP], 2).segments == (Segment(0, 0, 3, True),)


def test_a_prompt_of_separators_only_has_no_segment():
    result = cut([7, 8, 7, 8], [SEP], 0)
    assert result.segments == () and result.separators == ((0, 2), (2, 4))


def test_empty_segments_are_not_segments():
    result = cut([7, 8, 1, 7, 8, 7, 8, 2, 7, 8], [SEP], 1)
    assert [(s.start, s.end) for s in result.segments] == [(2, 3), (7, 8)]
    assert [s.index for s in result.segments] == [0, 1]


def test_a_trailing_separator_ends_the_last_segment():
    result = cut([1, 2, 7, 8], [SEP], 1)
    assert result.segments == (Segment(0, 0, 2, True),) and result.separators == ((2, 4),)


def test_a_separator_inside_a_document_cuts_it_the_same_way_in_every_prompt():
    document = [1] * 4 + list(SEP) + [2] * 4
    alone = cut(document, [SEP], 1)
    later = cut([5, 5] + list(SEP) + document, [SEP], 1)
    assert [document[s.start : s.end] for s in alone.segments] == [
        ([5, 5] + list(SEP) + document)[s.start : s.end] for s in later.segments[1:]
    ]


def test_segments_shorter_than_min_tokens_are_computed():
    result = cut([1] * 3 + list(SEP) + [2] * 4, [SEP], 4)
    assert [s.reusable for s in result.segments] == [False, True]
    assert all(s.reusable for s in cut([1] + list(SEP) + [2], [SEP], 0).segments)


def test_overlapping_matches_take_the_earlier():
    assert find_separators([9, 9, 9, 1], [(9, 9)]) == [(0, 2)]
    assert find_separators([9, 9, 9, 9], [(9, 9)]) == [(0, 2), (2, 4)]


def test_variants_are_all_found_and_the_longest_wins_at_one_position():
    assert find_separators([1, 7, 8, 2, 6, 8, 3], [(7, 8), (6, 8)]) == [(1, 3), (4, 6)]
    assert find_separators([7, 8, 9, 1], [(7, 8), (7, 8, 9)]) == [(0, 3)]


def test_no_separator_tokens_is_an_error():
    with pytest.raises(ValueError):
        find_separators([1, 2], [()])
    with pytest.raises(ValueError, match="encodes to no tokens"):
        separator_ids(lambda text: [], " # # ")
    assert separator_ids(lambda text: [5, 6], " # # ") == (5, 6)


def test_any_sequence_of_token_ids_is_accepted():
    assert cut((1, 7, 8, 2), [SEP], 1).separators == ((1, 3),)


tokens_st = st.lists(st.integers(0, 4), max_size=60)
variants_st = st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=3), min_size=1, max_size=3)


@settings(max_examples=300, deadline=None)
@given(tokens_st, variants_st, st.integers(0, 5))
def test_segments_and_separators_reassemble_the_prompt_exactly(tokens, variants, min_tokens):
    result = cut(tokens, variants, min_tokens)
    spans, parts = pieces(tokens, result)
    assert [t for part in parts for t in part] == tokens
    assert all(a < b for a, b in spans) and all(
        b == c for (_, b), (c, _) in zip(spans, spans[1:], strict=False)
    )
    assert all(tuple(tokens[a:b]) in {tuple(v) for v in variants} for a, b in result.separators)
    assert [s.index for s in result.segments] == list(range(len(result.segments)))
    assert all(s.reusable == (s.num_tokens >= max(min_tokens, 1)) for s in result.segments)


@settings(max_examples=300, deadline=None)
@given(tokens_st, variants_st)
def test_no_segment_holds_a_whole_separator(tokens, variants):
    for s in cut(tokens, variants, 0).segments:
        inner = tokens[s.start : s.end]
        assert not find_separators(inner, variants)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4).filter(lambda t: t != 7), min_size=1, max_size=8), max_size=6))
def test_documents_joined_by_the_separator_come_back_as_the_segments(documents):
    tokens = [t for i, d in enumerate(documents) for t in ([*SEP] if i else []) + d]
    result = cut(tokens, [SEP], 1)
    assert [tokens[s.start : s.end] for s in result.segments] == documents
