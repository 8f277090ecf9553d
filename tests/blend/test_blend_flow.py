"""LMCache's blend flow against KVLens (issue 39 items 1 and 2), on the tiny Llama in fp32.

With LMCache's example configuration file (``examples/blend_kv_v1/blending.yaml``), as its example
(``examples/blend_kv_v1/blend.py``) does: each document is sent once with the separator after it
(its KV computed and stored per segment), then prompts made of a system prompt, documents in
another order and a question, joined by the separator's token ids. The documents' KV comes back
from the CPU tier wherever they sit, moved to their new positions.

With every reused token recomputed (``blend_recompute_ratios: 1``) a blend is a full prefill by
vLLM's own modules, so the answers equal vLLM's alone (fp32): what this checks is the plumbing
(which tokens, which blocks, which positions), not CacheBlend's approximation (measured on the
real model in ``bench/``).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.integration.conftest import run_engine

pytestmark = pytest.mark.integration

# LMCache's own file (examples/blend_kv_v1/blending.yaml), read as LMCache reads it
EXAMPLE_CONFIG = Path(__file__).parents[1] / "unit" / "data" / "lmcache_configs" / "ex_blend_kv_v1.yaml"
DOC_TOKENS = 300  # one whole chunk (256) and a tail of 44
MAX_TOKENS = 6


def separator(model: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model).encode(" # # ", add_special_tokens=False)


def text(rng: random.Random, count: int, avoid: set[int]) -> list[int]:
    return [t for t in (rng.randrange(5, 1200) for _ in range(count * 2)) if t not in avoid][:count]


@pytest.fixture(scope="module")
def flow(tiny_model, tmp_path_factory):
    sep = separator(tiny_model)
    rng = random.Random(39)
    docs = [text(rng, DOC_TOKENS, set(sep)) for _ in range(3)]
    system, question = text(rng, 24, set(sep)), text(rng, 12, set(sep))

    def join(*parts: list[int]) -> list[int]:
        out: list[int] = []
        for i, part in enumerate(parts):
            out += (sep if i else []) + part
        return out

    blended = [join(system, docs[1], docs[0], question), join(system, docs[2], docs[1], docs[0], question)]
    rounds = [
        {"prompts": [d + sep for d in docs], "max_tokens": 1},  # each document computed once, stored
        {"prompts": blended, "max_tokens": MAX_TOKENS},
        {"prompts": [blended[0]], "max_tokens": MAX_TOKENS},  # again: the same KV, the same answer
    ]
    where = tmp_path_factory.mktemp("blend")
    env = {"LMCACHE_CONFIG_FILE": str(EXAMPLE_CONFIG), "LMCACHE_BLEND_RECOMPUTE_RATIOS": "1"}
    with_kvlens = run_engine({"model": tiny_model, "kv": {}, "rounds": rounds}, where, env=env)
    alone = run_engine(
        {"model": tiny_model, "kv": None, "rounds": [{"prompts": blended, "max_tokens": MAX_TOKENS}]},
        tmp_path_factory.mktemp("alone"),
    )
    return {"sep": sep, "docs": docs, "blended": blended, "kvlens": with_kvlens, "alone": alone["rounds"][0]}


def blend_of(output: dict) -> dict:
    return output["kv_transfer_params"]["kvlens"]["blend"]


def test_each_document_is_computed_once_and_stored_per_segment(flow):
    first = flow["kvlens"]["rounds"][0]
    for output in first:
        details = blend_of(output)
        assert details["reused_tokens"] == {}
        assert details["stored_chunks"] == 2  # its whole chunk and its tail
        assert details["recomputed_tokens"] == DOC_TOKENS + len(flow["sep"])


def test_documents_come_back_from_the_cpu_tier_in_another_order_and_answer_as_vllm_alone(flow):
    _, blended, again = flow["kvlens"]["rounds"]
    assert [o["token_ids"] for o in blended] == [o["token_ids"] for o in flow["alone"]]
    assert again[0]["token_ids"] == flow["alone"][0]["token_ids"]
    for output, documents in zip(blended, (2, 3), strict=True):
        details = blend_of(output)
        assert details["reused_tokens"] == {"cpu": documents * DOC_TOKENS}
        assert details["recomputed_tokens"] == len(flow["blended"][blended.index(output)])
        assert "unreadable_chunks" not in details and "failed" not in details
        # vLLM counts the blend's tokens as the connector's: all but the last
        assert output["num_cached_tokens"] == len(flow["blended"][blended.index(output)]) - 1
    state = flow["kvlens"]["state"]
    assert state["pinned_chunks"] == 0 and state["failed_blocks"] == []
