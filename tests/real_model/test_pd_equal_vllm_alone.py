"""Prefill/decode disaggregation on a real model (bf16, the servers' dtype): a chat's answer
through a prefiller and a decoder is the answer of vLLM alone, although the decoder computes
the first answer token as part of its prompt where vLLM alone decodes it: two correct paths that
sum in another order, so in bf16 the answers may part where vLLM alone nearly tied (agreement.py),
and nowhere else.
"""

from __future__ import annotations

import pytest

from tests.pd.conftest import CHUNK, started_pair

from . import chat_prompts
from .agreement import parting, same_answers
from .conftest import ONE_BY_ONE

pytestmark = pytest.mark.integration

TOKEN_BYTES = 30 * 2 * 3 * 64 * 2  # the real model: layers x (K, V) x KV heads x head size x bf16


@pytest.fixture(scope="module")
def real_pd_pair(real_model, tmp_path_factory):
    longest = max(len(p) for p in chat_prompts.prompts(real_model))
    buffer = (longest // CHUNK + 2) * CHUNK * TOKEN_BYTES  # one prompt at a time, with room to spare
    with started_pair(
        real_model,
        tmp_path_factory.mktemp("pd-real"),
        buffer,
        plain=False,
        traced=False,
        worker_process=False,
    ) as pair:  # the real model's answers: tests/pd runs the PD engines as deployed
        yield pair


def test_chats_answered_through_a_prefiller_and_a_decoder_are_vllm_alones_answers(
    real_pd_pair, vllm_alone, real_model, capsys
):
    alone = vllm_alone("bfloat16")  # one request at a time, as these are sent
    prompts = [chat_prompts.prompts(real_model)[i] for i in ONE_BY_ONE]
    for prompt, want, top in zip(prompts, alone["alone"], alone["alone_top"], strict=True):
        real_pd_pair.decoder.reset_prefix_cache()  # else it has the shared system prompt's blocks
        got = real_pd_pair.run(list(prompt), chat_prompts.MAX_TOKENS, ignore_eos=False)
        with capsys.disabled():
            print(f"\nPD {len(prompt)} tokens: {chat_prompts.decode(real_model, got['tokens'])!r}")
        assert same_answers([got["tokens"]], [want], [top], "bfloat16") == []
        if (p := parting(got["tokens"], want, top)) is not None:
            with capsys.disabled():
                print(f"   parted from vLLM alone at a near tie: {p}")
        received = got["decode"]["kv_transfer_params"]["kvlens"]["pd"]
        assert received["outcome"] == "loaded" and received["tokens"] == len(prompt), received
        assert got["decode"]["kv_transfer_params"]["num_lmcache_cached_tokens"] == len(prompt)
