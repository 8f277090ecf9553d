"""Two engines share one disk directory under load: neither ever fails a load because the
other evicted a chunk it was about to load, and the directory stays near its budget."""

import os
import threading

import pytest

from connector.tiers.disk import chunk_files

from . import workloads as w
from .conftest import disk_kv, expected, lmcache_tokens, outputs, run_engine

pytestmark = pytest.mark.integration

MB = 1024**2
BUDGET_GB = 12 * MB / 1024**3  # twelve 1 MiB chunks; each long prompt stores eleven


@pytest.fixture(scope="module")
def shared_runs(tiny_model, tmp_path_factory):
    shared = str(tmp_path_factory.mktemp("shared-kv"))
    kv = disk_kv(shared, max_local_disk_size=BUDGET_GB)
    tmp = tmp_path_factory.mktemp("two-engines")
    writer_spec = {"model": tiny_model, "kv": kv, "rounds": [{"prompts": [p]} for p in w.LONG]}
    # The reader stores its prompt once, then loads it back from disk round after round.
    reader_spec = {"model": tiny_model, "kv": kv, "rounds": [{"prompts": [w.A]} for _ in range(24)]}
    results: dict[str, dict] = {}
    errors: list[BaseException] = []

    def run(name, spec):
        try:
            results[name] = run_engine(spec, tmp, timeout=600)
        except BaseException as e:  # surfaced by the test
            errors.append(e)

    threads = [
        threading.Thread(target=run, args=a) for a in (("writer", writer_spec), ("reader", reader_spec))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    size = sum(os.path.getsize(path) for path in chunk_files(shared))
    return results["writer"], results["reader"], size


def test_no_load_fails_because_the_other_engine_evicted_the_chunk(shared_runs):
    writer, reader, _ = shared_runs
    assert reader["state"]["failed_blocks"] == []
    assert writer["state"]["failed_blocks"] == []


def test_the_reader_keeps_being_served_from_the_shared_disk(shared_runs, baseline):
    _, reader, _ = shared_runs
    served = [lmcache_tokens(r)[0] for r in reader["rounds"][1:]]
    # LRU under a writer that fills the directory every second may evict the reader's chunks
    # between two uses (they are then stored again): a miss, never a failure. How often depends
    # on how the two engines' steps interleave on a busy machine: 17 of 23 rounds were served in
    # one full-suite run, all 23 in a run alone; a broken shared directory serves none.
    assert sum(n == 640 for n in served) >= 2 / 3 * len(served), str(served)
    for rnd in reader["rounds"]:
        assert outputs(rnd) == expected(baseline, [w.A])


def test_the_directory_stays_near_its_budget(shared_runs):
    *_, size = shared_runs
    # Kept in use by the reader for the grace period, its prompt may sit above the budget.
    assert size <= 12 * MB + 3 * MB + 64 * 1024, size
