"""The real model (SmolLM2-135M-Instruct, made by scripts/setup.sh) in vLLM with and without
KVLens. Every engine here is an offline engine in a fresh process (tests/integration's runner);
what several tests compare against (vLLM alone, per dtype) is computed once per test run."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.conftest import once_per_test_run, run_engine

from . import chat_prompts

TOP_N = 5  # vLLM alone's top logprobs kept per answer position (agreement.py)
# Prompts (indices of chat_prompts.conversations()) also computed one at a time, in bf16: what the
# PD test sends, one request at a time, as its servers get them.
ONE_BY_ONE = (0, 4, 5)


def plain_rounds(prompts, one_by_one: bool, **extra) -> list[dict]:
    """Rounds of greedy chat answers: the whole batch at once, or each prompt alone (as a server
    that gets requests one at a time computes them)."""
    batches = [[p] for p in prompts] if one_by_one else [list(prompts)]
    return [
        {"prompts": b, "max_tokens": chat_prompts.MAX_TOKENS, "ignore_eos": False, **extra} for b in batches
    ]


@pytest.fixture(scope="session")
def vllm_alone(real_model, tmp_path_factory):
    """``vllm_alone(dtype, which)``: greedy answers of vLLM without KVLens to the chat prompts
    ``which`` (indices; default all), sent as one batch (``["batch"]``), in bf16 also those of
    ``ONE_BY_ONE`` one at a time (``["alone"]``), and the top logprobs of every answer position
    (``["batch_top"]``, ``["alone_top"]``)."""
    cache: dict[tuple, dict[str, list]] = {}

    def get(dtype: str, which: tuple[int, ...] | None = None) -> dict[str, list]:
        every = chat_prompts.prompts(real_model)
        which = tuple(range(len(every))) if which is None else which
        if (dtype, which) not in cache:
            prompts = [list(every[i]) for i in which]
            alone_too = dtype == "bfloat16" and len(which) == len(every)

            def run() -> dict[str, list]:
                rounds = plain_rounds(prompts, False, logprobs=TOP_N)
                if alone_too:
                    rounds += plain_rounds([list(every[i]) for i in ONE_BY_ONE], True, logprobs=TOP_N)
                spec = {"model": real_model, "kv": None, "engine": {"dtype": dtype}, "rounds": rounds}
                got = run_engine(spec, tmp_path_factory.mktemp(f"alone-{dtype}"))["rounds"]
                alone = [r[0] for r in got[1:]]
                return {
                    "batch": [o["token_ids"] for o in got[0]],
                    "batch_top": [o["top_logprobs"] for o in got[0]],
                    "alone": [o["token_ids"] for o in alone],
                    "alone_top": [o["top_logprobs"] for o in alone],
                }

            name = f"real-model-alone-{dtype}-{'-'.join(map(str, which))}"
            cache[(dtype, which)] = once_per_test_run(tmp_path_factory, name, run)
        return cache[(dtype, which)]

    return get


@pytest.fixture(scope="package")
def redis_url(tmp_path_factory) -> Iterator[str]:
    from tests.redis.servers import running_redis_url

    with running_redis_url(tmp_path_factory.mktemp("redis")) as url:
        yield url
