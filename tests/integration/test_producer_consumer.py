"""A producer engine stores to a shared disk tier; a separate consumer engine only loads."""

import pytest

from connector.tiers.disk import chunk_files

from . import workloads as w
from .conftest import disk_kv, expected, lmcache_tokens, outputs, run_engine

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def shared_runs(tiny_model, tmp_path_factory):
    shared = str(tmp_path_factory.mktemp("shared-disk"))
    kv = disk_kv(shared)
    tmp = tmp_path_factory.mktemp("pc")
    producer = run_engine(
        {
            "model": tiny_model,
            "kv": kv,
            "role": "kv_producer",
            "rounds": [{"prompts": [w.A]}, {"prompts": [w.A]}],
        },
        tmp,
    )
    files_after_producer = chunk_files(shared)
    consumer = run_engine(
        {"model": tiny_model, "kv": kv, "role": "kv_consumer", "rounds": [{"prompts": [w.A, w.C]}]}, tmp
    )
    return producer, consumer, files_after_producer, chunk_files(shared)


def test_producer_stores_but_never_loads(shared_runs, baseline):
    producer, _, files, _ = shared_runs
    assert len(files) == 3  # two chunks and A's tail cut to a whole block
    assert lmcache_tokens(producer["rounds"][1]) == [0]
    assert outputs(producer["rounds"][1]) == expected(baseline, [w.A])


def test_consumer_loads_what_the_producer_stored_and_stores_nothing(shared_runs, baseline):
    _, consumer, before, after = shared_runs
    (rnd,) = consumer["rounds"]
    assert lmcache_tokens(rnd) == [640, 256]
    assert rnd[0]["num_cached_tokens"] >= 640
    assert outputs(rnd) == expected(baseline, [w.A, w.C])
    assert after == before
    assert consumer["state"]["pinned_chunks"] == 0
