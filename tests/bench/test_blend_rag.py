"""bench/blend_rag.py builds LMCache's blend flow on the RAG set: the prompts cut, with the
connector's own cut, into the chat head, the documents and the question; every document is a
reusable segment at the bench's blend_min_tokens, found again in every prompt holding it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import blend_rag  # noqa: E402
from bench.lib import rag_set as rag  # noqa: E402
from bench.lib.models import real_model_dir  # noqa: E402
from bench.lib.modes import BLEND_MIN_TOKENS, KVLENS_TIERS, Settings  # noqa: E402
from connector.engine.segments import cut  # noqa: E402


@pytest.fixture(scope="module")
def model() -> Path:
    path = real_model_dir()
    if not (path / "config.json").exists():
        pytest.skip("the real model is made by scripts/setup.sh")
    return path


@pytest.mark.parametrize("count", [4, 8])
def test_each_prompt_cuts_into_head_documents_and_question(model, count):
    questions = [q for d in rag.DOCUMENTS for q in rag.questions_for(d.key)[:1]]
    sep = [list(blend_rag.separator_ids(model))]
    where = set()
    for q, order in zip(questions, blend_rag.orders(count, questions), strict=True):
        assert q.document in order and len(set(order)) == count
        where.add(order.index(q.document))
        ids = blend_rag.blend_prompt(model, q, order)
        parts = cut(ids, sep, BLEND_MIN_TOKENS)
        segments = [list(ids[s.start : s.end]) for s in parts.segments]
        assert segments[1:-1] == [list(blend_rag.document_ids(model, k)) for k in order]
        assert [s.reusable for s in parts.segments[1:-1]] == [True] * count
    assert len(where) > 1  # the question's document moves from prompt to prompt


def test_the_blend_modes_turn_blending_on_at_the_default_ratio_and_at_zero(tmp_path):
    settings = Settings(storage_dir=tmp_path)
    default, zero = KVLENS_TIERS["cpu-blend"](settings), KVLENS_TIERS["cpu-blend0"](settings)
    assert default["lmcache.enable_blending"] and "lmcache.blend_recompute_ratios" not in default
    assert zero["lmcache.blend_recompute_ratios"] == 0.0
