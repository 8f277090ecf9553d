"""The RAG set (bench/lib/rag_set.py): its scoring, its prompts, and its own consistency."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.lib import rag_set as rag

REPO = Path(__file__).resolve().parents[2]


def question(key: str) -> rag.Question:
    return next(q for q in rag.QUESTIONS if q.key == key)


def test_every_question_is_answered_in_its_own_document():
    for q in rag.QUESTIONS:
        sentences = re.split(r"(?<=\.)\s+", rag.document(q.document).text)
        assert any(rag.is_correct(s, q) for s in sentences), q.key


def test_each_question_needs_one_document_that_exists():
    keys = {d.key for d in rag.DOCUMENTS}
    assert all(q.document in keys for q in rag.QUESTIONS)
    assert len({q.key for q in rag.QUESTIONS}) == len(rag.QUESTIONS)
    assert all(2 <= len(rag.questions_for(k)) <= 4 for k in keys)
    assert 6 <= len(rag.DOCUMENTS) <= 10


def test_an_answer_matches_its_aliases_after_normalising():
    q = question("library-books")
    assert rag.is_correct("Members may borrow up to twelve books.", q)
    assert rag.is_correct("12", q)
    assert rag.is_correct("TWELVE!", q)
    assert not rag.is_correct("They may borrow 21 books.", q)


def test_a_number_matches_whole_numbers_only():
    q = question("ferry-pier")  # 9
    assert rag.is_correct("They leave from Pier 9.", q)
    assert not rag.is_correct("They leave from Pier 19.", q)


def test_thousands_separators_and_case_and_accents_do_not_matter():
    q = question("observatory-altitude")
    for said in ("3,120 metres", "3120 m", "It stands at 3 120 metres."):
        assert rag.is_correct(said, q), said
    assert not rag.is_correct("31,200 metres", q)
    assert rag.is_correct("It holds 1.6 LITRES.", question("kettle-capacity"))
    assert not rag.is_correct("It holds 1.65 litres.", question("kettle-capacity"))
    assert rag.is_correct("Marvéjac", question("council-twin"))


def test_only_the_first_sentence_counts():
    q = question("vacuum-modes")  # 4
    assert not rag.is_correct(
        "The R7 has 2 cleaning modes: quiet and standard. The R7 has 4 cleaning modes.", q
    )
    assert rag.is_correct("The R7 has 4 cleaning modes. It also has 2 brushes.", q)
    assert rag.is_correct("It holds 1.6 litres. It weighs 1.1 kilograms.", question("kettle-capacity"))


def test_a_word_inside_another_word_is_not_an_answer():
    q = question("festival-mascot")  # Pip
    assert not rag.is_correct("The mascot is a pipe.", q)
    assert rag.is_correct("Its mascot is Pip, a hedgehog.", q)


def test_messages_put_the_documents_in_order_before_the_question():
    q = question("kettle-city")
    order = rag.ORDERS["shuffled"]
    msgs = rag.messages(q, order)
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert msgs[0]["content"] == rag.SYSTEM_PROMPT
    user = msgs[1]["content"]
    starts = [user.index(rag.document(k).title) for k in order]
    assert starts == sorted(starts)
    assert user.endswith(rag.QUESTION_PREFIX + q.text)
    assert user.startswith(rag.documents_text(order))


def test_every_order_shares_its_documents_text_across_questions():
    order = rag.ORDERS["reversed"]
    prefix = rag.documents_text(order)
    assert all(rag.user_message(q, order).startswith(prefix) for q in rag.QUESTIONS)
    for key in order:  # each document appears whole, followed by the separator
        assert rag.document(key).render() + rag.SEPARATOR in prefix


def test_the_named_orders_are_permutations_of_every_document():
    canonical = rag.canonical_order()
    for name, order in rag.ORDERS.items():
        assert sorted(order) == sorted(canonical), name
    assert rag.ORDERS["shuffled"] != canonical
    assert rag.permuted_order(38) == rag.ORDERS["shuffled"]


def test_a_question_without_its_document_is_refused():
    q = question("vacuum-app")
    with pytest.raises(ValueError, match="vacuum"):
        rag.messages(q, ("ferry", "library"))


def test_a_subset_of_documents_with_the_needed_one_is_a_prompt():
    q = question("vacuum-app")
    user = rag.messages(q, ("vacuum", "ferry"))[1]["content"]
    assert "Brisco R7" in user and "Quillfeather" not in user


def test_no_document_contains_the_separator():
    for d in rag.DOCUMENTS:
        assert rag.SEPARATOR not in d.render(), d.key


def test_the_module_imports_with_the_standard_library_alone():
    code = (
        "import sys; sys.path.insert(0, '.'); import bench.lib.rag_set\n"
        "third = sorted(m for m in sys.modules if m.split('.')[0] in ('aiohttp', 'numpy', 'torch', 'vllm'))\n"
        "bench = sorted(m for m in sys.modules if m.startswith('bench.') and m != 'bench.lib.rag_set' "
        "and m != 'bench.lib')\n"
        "print(third, bench)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] []"


def test_token_agreement_counts_the_tokens_before_the_first_difference():
    assert rag.token_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert rag.token_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    assert rag.token_agreement([1, 2, 3, 4], [7, 2, 3, 4]) == 0.0
    assert rag.token_agreement([], []) == 1.0


def test_an_answer_that_stops_early_or_runs_on_does_not_agree_in_full():
    assert rag.token_agreement([1, 2, 3, 4], [1, 2]) == 0.5
    assert rag.token_agreement([1, 2], [1, 2, 3, 4]) == 0.5


def _rec(rep: int, *answers: list[int]) -> dict:
    return {"repetition": rep, "answers": [{"token_ids": a} for a in answers]}


def test_agreement_compares_each_mode_with_full_prefill_of_the_same_repetition():
    from bench import rag_quality

    records = {
        "canonical": {
            "full": [_rec(0, [1, 2], [3, 4]), _rec(1, [1, 2], [3, 5])],
            "none": [_rec(0, [1, 2], [3, 4]), _rec(1, [1, 2], [3, 4])],
            "kvlens-cpu": [_rec(0, [1, 9], [3, 4]), _rec(1, [1, 2], [3, 5])],
        }
    }
    rag_quality.agreement(records, "full")
    full, none, kvlens = (records["canonical"][m] for m in ("full", "none", "kvlens-cpu"))
    assert [r["exact_vs_full"] for r in kvlens] == [0.5, 1.0]
    assert kvlens[0]["tokens_vs_full"] == 0.75
    assert [r["exact_vs_full"] for r in none] == [1.0, 0.5]
    # full prefill against its own first repetition: whether it repeats itself
    assert [r["exact_vs_full"] for r in full] == [1.0, 0.5]
    assert [r["exact_vs_prefix_cache"] for r in kvlens] == [0.5, 0.5]
    assert "exact_vs_prefix_cache" not in none[0]


def test_the_documents_prefix_is_what_every_prompt_starts_with():
    from bench import rag_quality

    assert rag_quality.common_prefix([[1, 2, 3, 4], [1, 2, 3, 9], [1, 2, 7]]) == [1, 2]
    assert rag_quality.common_prefix([[1, 2], [1, 2, 3]]) == [1, 2]
