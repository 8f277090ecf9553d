"""A real model's greedy answers to chat prompts are the same with KVLens as with vLLM alone,
whichever tier the prompt's KV comes back from (CPU, disk, Redis), and (fp32) with tensor
parallelism (TP=3: the model's 9 attention heads and 3 KV heads allow 1 or 3).

Two KVLens instances run one after the other, as two instances of a deployment would, at
KVLens's default settings besides their tiers: the first (disk and Redis, no CPU tier) stores
every prompt, then answers again from its disk; the second, started afterwards with a CPU tier
and the same Redis, answers first from Redis (KV the other instance computed), then from its CPU
tier (where what it read from Redis was kept). vLLM's prefix cache is reset between rounds, so a
reused token comes from KVLens or, within a round, from another prompt's blocks. Both run in
bf16; fp32 (four times slower here) is the TP=3 instance's, which loads from its CPU tier.
"""

from __future__ import annotations

import pytest

from tests.integration.conftest import run_engine

from . import chat_prompts
from .agreement import partings, same_answers
from .conftest import plain_rounds

pytestmark = pytest.mark.integration

BF16 = "bfloat16"  # the tier instances' dtype; fp32 (four times slower here): the TP=3 test
CHUNK = 256  # KVLens's default chunk_size; the unfull last chunk is not stored by default
TP3 = {"tensor_parallel_size": 3}
TP3_CORES = {"VLLM_CPU_OMP_THREADS_BIND": "0|1|1"}  # three ranks on this machine's two cores
TP_PROMPTS = (0, 4)  # chat_prompts.conversations(): a question, and a second turn after it
TP_MAX_TOKENS = 12


def whole_chunks(prompt) -> int:
    """Tokens of a prompt that KVLens can hand back: its whole chunks, never the last token."""
    return (len(prompt) - 1) // CHUNK * CHUNK


@pytest.fixture(scope="module")
def runs(real_model, redis_url, tmp_path_factory):
    """``runs(instance)``: an instance's two rounds, bf16 ("disk_redis" or "cpu_redis"; the first
    always runs before the second, which reads what it stored in Redis); ``runs.tp(dtype)``: the
    TP=3 instance's."""
    prompts = [list(p) for p in chat_prompts.prompts(real_model)]
    done: dict[str, list] = {}

    def run(kv: dict, name: str) -> list:
        spec = {
            "model": real_model,
            "kv": kv,
            "engine": {"dtype": BF16},
            "rounds": plain_rounds(prompts, False) * 2,
        }
        return run_engine(spec, tmp_path_factory.mktemp(name))["rounds"]

    def get(instance: str) -> list:
        redis = {"lmcache.remote_url": redis_url}
        if "disk_redis" not in done:
            disk = {**redis, "lmcache.local_cpu": False, "lmcache.max_local_disk_size": 1}
            disk["lmcache.local_disk"] = str(tmp_path_factory.mktemp("disk"))
            done["disk_redis"] = run(disk, "disk-redis")
        if instance not in done:
            done[instance] = run(redis, instance)
        return done[instance]

    def tp(dtype: str) -> list:  # two prompts and short answers: three ranks share two cores
        rounds = [
            {"prompts": [prompts[i] for i in TP_PROMPTS], "max_tokens": TP_MAX_TOKENS, "ignore_eos": False}
        ]
        spec = {"model": real_model, "kv": {}, "engine": {"dtype": dtype, **TP3}, "rounds": rounds * 2}
        return run_engine(spec, tmp_path_factory.mktemp(f"tp3-{dtype}"), env=TP3_CORES)["rounds"]

    get.tp = tp
    return get


def answers(round_result) -> list[list[int]]:
    return [o["token_ids"] for o in round_result]


def loaded(round_result) -> list[dict[str, int]]:
    return [o["kv_transfer_params"]["kvlens"]["loaded_tokens"] for o in round_result]


def reused(round_result) -> list[int]:
    """Prompt tokens not computed: loaded by KVLens, or vLLM's hits on blocks of this round."""
    return [o["num_cached_tokens"] for o in round_result]


def show(model: str, title: str, round_result, alone, capsys) -> None:
    with capsys.disabled():
        print(f"\n{title}")
        for o in round_result:
            print(f"   {o['num_cached_tokens']:5d} reused  {chat_prompts.decode(model, o['token_ids'])!r}")
        for p in partings(answers(round_result), alone["batch"], alone["batch_top"]):
            print(f"   parted from vLLM alone at a near tie: {p}")


def test_an_instance_stores_every_chat_then_answers_from_its_disk_as_vllm_alone(
    runs, vllm_alone, real_model, capsys
):
    cold, warm = runs("disk_redis")
    alone = vllm_alone(BF16)
    show(real_model, f"{BF16}, answered from disk:", warm, alone, capsys)
    assert same_answers(answers(cold), alone["batch"], alone["batch_top"], BF16) == []
    assert loaded(cold) == [{}] * len(cold)
    assert same_answers(answers(warm), alone["batch"], alone["batch_top"], BF16) == []
    prompts = chat_prompts.prompts(real_model)
    assert loaded(warm) == [{"disk": whole_chunks(p)} if whole_chunks(p) else {} for p in prompts]


def test_another_instance_answers_from_redis_then_from_its_cpu_tier_as_vllm_alone(
    runs, vllm_alone, real_model
):
    from_redis, from_cpu = runs("cpu_redis")
    alone = vllm_alone(BF16)
    for rnd in (from_redis, from_cpu):
        assert same_answers(answers(rnd), alone["batch"], alone["batch_top"], BF16) == []
    prompts = chat_prompts.prompts(real_model)
    assert loaded(from_redis) == [{"remote": whole_chunks(p)} if whole_chunks(p) else {} for p in prompts]
    # from its CPU tier now: what one prompt loads, the batch's others may find in vLLM's cache
    sources = {source for x in loaded(from_cpu) for source in x}
    assert sources == {"cpu"}, loaded(from_cpu)
    assert reused(from_cpu) == [whole_chunks(p) for p in prompts]


def test_tensor_parallel_ranks_each_load_their_share_and_answer_as_vllm_alone(runs, vllm_alone, real_model):
    """fp32, TP=3 with a CPU tier, two chats (a question, then a second turn after it), against
    vLLM alone on one rank (the ranks' partial sums part from it at near ties at most)."""
    cold, warm = runs.tp("float32")
    alone = vllm_alone("float32", TP_PROMPTS)
    want = [answer[:TP_MAX_TOKENS] for answer in alone["batch"]]
    tops = alone["batch_top"]
    for rnd in (cold, warm):
        assert same_answers(answers(rnd), want, tops, "float32") == []
    prompts = [chat_prompts.prompts(real_model)[i] for i in TP_PROMPTS]
    assert {s for x in loaded(warm) for s in x} == {"cpu"}, loaded(warm)
    assert reused(warm) == [whole_chunks(p) for p in prompts]
