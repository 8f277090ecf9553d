"""tests/real_model/agreement.py: an answer is vLLM alone's if equal, or if it parts only where
vLLM alone itself nearly tied; anywhere else it is wrong."""

from __future__ import annotations

from tests.real_model.agreement import Parting, parting, same_answers

TOP = [[[5, -0.01], [6, -4.0]], [[7, -0.50], [8, -0.75], [9, -3.0]], [[1, -0.1], [2, -2.5]]]


def test_equal_answers_do_not_part():
    assert parting([5, 7, 1], [5, 7, 1], TOP) is None
    assert same_answers([[5, 7, 1]], [[5, 7, 1]], [TOP], "float32") == []


def test_a_parting_at_a_near_tie_is_the_same_answer_in_bf16_but_not_in_fp32():
    assert parting([5, 8, 4], [5, 7, 1], TOP) == Parting(1, 8, 7, 0.25)
    assert same_answers([[5, 8, 4]], [[5, 7, 1]], [TOP], "bfloat16") == []
    assert same_answers([[5, 8, 4]], [[5, 7, 1]], [TOP], "float32") != []  # 0.25 nat: not a tie in fp32


def test_a_parting_where_vllm_alone_was_sure_is_wrong():
    wrong = same_answers([[6, 7, 1]], [[5, 7, 1]], [TOP], "bfloat16")
    assert wrong == [f"prompt 0: {Parting(0, 6, 5, 3.99)}"]


def test_a_token_vllm_alone_did_not_rank_is_wrong():
    assert parting([5, 3, 1], [5, 7, 1], TOP) == Parting(1, 3, 7, None)
    assert same_answers([[5, 3, 1]], [[5, 7, 1]], [TOP], "bfloat16") != []


def test_an_answer_that_stops_early_or_goes_on_is_wrong():
    assert same_answers([[5, 7]], [[5, 7, 1]], [TOP], "bfloat16") != []
    assert same_answers([[5, 7, 1, 2]], [[5, 7, 1]], [TOP], "bfloat16") != []
