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
import re
import shutil
from pathlib import Path

import pytest

from bench.lib.ports import free_port
from grafana.blend_panels import BLEND_PANELS
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
    env["KVLENS_METRICS_PORT"] = str(free_port())  # the offline engine's /metrics, read at its end
    with_kvlens = run_engine({"model": tiny_model, "kv": {}, "rounds": rounds}, where, env=env)
    alone = run_engine(
        {"model": tiny_model, "kv": None, "rounds": [{"prompts": blended, "max_tokens": MAX_TOKENS}]},
        tmp_path_factory.mktemp("alone"),
    )
    return {
        "sep": sep,
        "docs": docs,
        "blended": blended,
        "rounds": rounds,
        "kvlens": with_kvlens,
        "alone": alone["rounds"][0],
    }


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


@pytest.fixture(scope="module")
def tensor_parallel(flow, tiny_model, tmp_path_factory):
    """The same flow at KVLens's default ratio with TP=2 and a disk tier, one rank's copy of one
    stored chunk damaged between the documents and the prompts that reuse them."""
    disk = tmp_path_factory.mktemp("blend-disk")
    kv = {
        "lmcache.enable_blending": True,
        "lmcache.local_cpu": False,
        "lmcache.local_disk": str(disk),
        "lmcache.max_local_disk_size": 1,
    }
    documents, blended, _ = flow["rounds"]
    rounds = [documents, {**blended, "damage": {"dir": str(disk), "corrupt": 1, "rank": 1, "smallest": True}}]
    spec = {"model": tiny_model, "kv": kv, "rounds": rounds, "engine": {"tensor_parallel_size": 2}}
    return run_engine(spec, tmp_path_factory.mktemp("blend-tp"), env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})


def test_under_tensor_parallelism_a_chunk_one_rank_cannot_read_is_computed_by_every_rank(
    tensor_parallel, flow
):
    """Rank 1's copy of one document's tail is damaged; rank 0's is good. Both ranks compute it
    (each rank's layers all-reduce over the same tokens, or the step would fail or hang), and the
    response names the chunk that could not be used."""
    stored, blended = tensor_parallel["rounds"]
    assert [blend_of(o)["stored_chunks"] for o in stored] == [2, 2, 2]
    everything = blend_of(blended[1])  # all three documents: the damaged tail among them
    assert everything["reused_tokens"] == {"disk": 3 * DOC_TOKENS - 44}
    assert len(everything["unreadable_chunks"]) == 1
    # the first blend to read it finds it damaged (and the disk tier deletes it): corrupt, then missing
    reasons = [c["reason"] for o in blended for c in blend_of(o).get("unreadable_chunks", [])]
    assert reasons[0] == "corrupt" and set(reasons) <= {"corrupt", "missing"}, reasons
    assert "failed" not in everything and everything["recomputed_by_deviation"] > 0
    for output, prompt in zip(blended, flow["blended"], strict=True):
        assert output["num_cached_tokens"] == len(prompt) - 1 and len(output["token_ids"]) == MAX_TOKENS
    assert tensor_parallel["state"]["failed_blocks"] == [] and tensor_parallel["state"]["pinned_chunks"] == 0


def test_the_blending_rows_series_have_data(flow):
    """Every series the Grafana Blending row reads is on /metrics with a value (the live-stack test
    skips the row: its engine does not blend)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(flow["kvlens"]["state"]["metrics"]):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    used = {n for p in BLEND_PANELS for t in p.targets for n in re.findall(r"vllm:kvlens_\w+", t.expr)}
    assert used and {n: totals.get(n, 0.0) for n in used if not totals.get(n)} == {}
    assert totals["vllm:kvlens_blend_requests_total"] == 6  # three documents, then three blended prompts


@pytest.fixture(scope="module")
def two_hosts_over_redis(flow, tiny_model, tmp_path_factory):
    """Two instances, each with its own copy of the checkpoint, sharing Redis only (no CPU tier):
    the first computes the documents (stored per segment in Redis); then one stored chunk's value
    is overwritten in place, as anyone who can write the key prefix could; the second blends the
    prompts from what Redis holds."""
    from tests.redis.servers import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("blend-redis")).start()
    try:
        kv = {
            "lmcache.enable_blending": True,
            "lmcache.blend_recompute_ratios": 1,
            "lmcache.local_cpu": False,
            "lmcache.remote_url": server.url,
            "lmcache.extra_config": {"remote_key_prefix": "blendr"},
        }
        documents, blended, _ = flow["rounds"]
        hosts = []
        for name in ("host-a", "host-b"):
            model = tmp_path_factory.mktemp(name) / "model"
            shutil.copytree(tiny_model, model)
            hosts.append(str(model))
        where = tmp_path_factory.mktemp("a")
        stored = run_engine({"model": hosts[0], "kv": kv, "rounds": [documents]}, where)
        raw = server.client()
        chunks = [k for k in raw.keys("blendr:*") if re.fullmatch(rb"blendr:[0-9a-f]{16,}\.r0", k)]
        planted = min(chunks, key=raw.strlen)  # a document's tail
        middle = raw.strlen(planted) // 2
        raw.setrange(planted, middle, b"\x5a" * 64)
        reused = run_engine({"model": hosts[1], "kv": kv, "rounds": [blended]}, tmp_path_factory.mktemp("b"))
        repaired = raw.getrange(planted, middle, middle + 63) != b"\x5a" * 64
        return {"stored": stored, "reused": reused, "chunks": len(chunks), "repaired": repaired}
    finally:
        server.kill()


def test_another_host_blends_from_redis_and_computes_a_record_changed_there(two_hosts_over_redis, flow):
    """Segments are found in Redis by content, wherever they sit, by an instance that did not
    store them; a record whose bytes were changed in Redis is not used: it is computed, named in
    the response (remote, corrupt), and written again (a later blend may read the good copy);
    the answers stay vLLM's alone."""
    assert two_hosts_over_redis["chunks"] == 6  # three documents, each a whole chunk and a tail
    (blended,) = two_hosts_over_redis["reused"]["rounds"]
    assert [o["token_ids"] for o in blended] == [o["token_ids"] for o in flow["alone"]]
    problems = [(c["tier"], c["reason"]) for o in blended for c in blend_of(o).get("unreadable_chunks", [])]
    assert problems and set(problems) == {("remote", "corrupt")}
    for output, documents in zip(blended, (2, 3), strict=True):
        details = blend_of(output)
        unreadable = len(details.get("unreadable_chunks", []))  # the changed one: a 44-token tail
        assert details["reused_tokens"] == {"remote": documents * DOC_TOKENS - 44 * unreadable}
    assert two_hosts_over_redis["repaired"]
    assert two_hosts_over_redis["reused"]["state"]["failed_blocks"] == []
