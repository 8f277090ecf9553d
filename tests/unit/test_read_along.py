"""Weight files hashed beside the loader's read: the digests the scheduler then finds remembered
are those of the bytes the loader read, and nothing else; no vLLM here."""

import os
import threading
import time
from types import ModuleType, SimpleNamespace

import pytest

from connector.identity import read_along
from connector.identity import weights_digests as wd
from connector.identity.checkpoint import fingerprint
from connector.identity.read_along import ReadAlong, flock_claims, natural_order, plan_segments
from connector.identity.weights_digests import DigestCache
from connector.vllm_plugin import weights_hook

SEG = 4096


@pytest.fixture(autouse=True)
def small_segments(monkeypatch):
    monkeypatch.setattr(wd, "SEGMENT_BYTES", SEG)


@pytest.fixture
def cache_path(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "weights-digests.json"
    monkeypatch.setenv(wd.ENV, str(path))
    return str(path)


def shards(folder, sizes=(3 * SEG + 100, SEG, 10)):
    folder.mkdir(exist_ok=True)
    paths = []
    for k, size in enumerate(sizes):
        p = folder / f"model-{k + 1:05d}-of-{len(sizes):05d}.safetensors"
        p.write_bytes(os.urandom(size))
        paths.append(str(p))
    return paths


def read_along_of(paths, cache_path, **kw):
    return ReadAlong(paths, DigestCache(cache_path), flock_claims(cache_path + ".claims"), **kw)


def test_the_scheduler_finds_every_digest_remembered_and_they_equal_its_own(tmp_path, cache_path):
    paths = shards(tmp_path / "ckpt")
    along = read_along_of(paths, cache_path)
    along.advance(10**9)
    out = along.finish()
    assert (out.hashed, out.changed, out.hashed_bytes) == (3, 0, sum(os.path.getsize(p) for p in paths))
    remembered = fingerprint(str(tmp_path / "ckpt"), DigestCache(cache_path))
    assert remembered.read_bytes == 0 and remembered.cached_files == 3
    assert remembered.digest == fingerprint(str(tmp_path / "ckpt")).digest


def test_files_are_hashed_in_the_loaders_order_and_never_further_ahead_than_the_bound(
    tmp_path, cache_path, monkeypatch
):
    paths = shards(tmp_path / "ckpt")
    seen = []
    real = wd.segment_digest
    monkeypatch.setattr(
        wd, "segment_digest", lambda p, i: seen.append((os.path.basename(p), i)) or real(p, i)
    )
    along = read_along_of(list(reversed(paths)), cache_path, threads=2, ahead_bytes=2 * SEG)
    deadline = time.monotonic() + 5
    while len(seen) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert sorted(seen) == [("model-00001-of-00003.safetensors", 0), ("model-00001-of-00003.safetensors", 1)]
    along.advance(SEG)
    while len(seen) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert len(seen) == 3
    assert along.finish().hashed == 3
    assert len(seen) == 6


def test_a_file_written_while_read_is_not_remembered(tmp_path, cache_path):
    paths = shards(tmp_path / "ckpt")
    along = read_along_of(paths, cache_path)
    time.sleep(0.01)
    with open(paths[1], "r+b") as f:  # in place, same size: only ctime tells
        f.write(b"x")
    out = along.finish()
    assert (out.hashed, out.changed) == (2, 1)
    found = fingerprint(str(tmp_path / "ckpt"), DigestCache(cache_path))
    assert found.cached_files == 2 and found.read_bytes == os.path.getsize(paths[1])


def test_a_file_replaced_while_read_is_not_remembered(tmp_path, cache_path):
    paths = shards(tmp_path / "ckpt")
    along = read_along_of(paths, cache_path)
    (tmp_path / "new").write_bytes(os.urandom(SEG))
    os.replace(tmp_path / "new", paths[0])
    assert along.finish().changed == 1
    assert fingerprint(str(tmp_path / "ckpt"), DigestCache(cache_path)).cached_files == 2


def test_each_file_is_hashed_by_one_rank_only(tmp_path, cache_path):
    paths = shards(tmp_path / "ckpt")
    first = read_along_of(paths, cache_path, ahead_bytes=0)  # holds its claims until finished
    second = read_along_of(paths, cache_path)
    assert (second.claimed_elsewhere, second.finish().hashed) == (3, 0)
    assert first.finish().hashed == 3
    third = read_along_of(paths, cache_path)  # a restart: stats only
    assert (third.remembered, third.finish().hashed_bytes) == (3, 0)


def test_an_abandoned_load_remembers_nothing_and_frees_its_claims(tmp_path, cache_path):
    paths = shards(tmp_path / "ckpt")
    read_along_of(paths, cache_path, ahead_bytes=0).abort()
    again = read_along_of(paths, cache_path)
    assert again.claimed_elsewhere == 0 and again.remembered == 0
    assert again.finish().hashed == 3


def test_a_read_that_fails_raises_from_finish_and_frees_the_claims(tmp_path, cache_path):
    paths = shards(tmp_path / "ckpt")
    along = read_along_of(paths, cache_path, ahead_bytes=0)
    os.unlink(paths[2])
    with pytest.raises(OSError):
        along.finish()
    assert read_along_of(paths[:2], cache_path).claimed_elsewhere == 0


def test_saves_at_once_keep_every_digest(tmp_path):
    path = str(tmp_path / "d.json")
    caches = [DigestCache(path) for _ in range(8)]
    for k, c in enumerate(caches):
        c.put(f"v{k}", f"{k:032x}")
    threads = [threading.Thread(target=c.save) for c in caches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(DigestCache(path).get(f"v{k}") == f"{k:032x}" for k in range(8))


def test_reading_order_and_offsets_follow_vllm():
    assert natural_order(["/m/model-10.st", "/m/model-2.st"]) == ["/m/model-2.st", "/m/model-10.st"]
    assert plan_segments([SEG + 1, 0, 5]) == [(0, 0, 0), (0, 1, SEG), (1, 0, SEG + 1), (2, 0, SEG + 1)]


# The plugin's hook, on a stand-in for vLLM's default_loader module.


def fake_loader_module(fail_after=None):
    module = ModuleType("fake_default_loader")

    class BaseModelLoader:
        def load_model(self, vllm_config, model_config):
            return list(module.safetensors_weights_iterator(model_config.files, False))

    def safetensors_weights_iterator(files, use_tqdm):
        for k, path in enumerate(natural_order(files)):
            if fail_after is not None and k == fail_after:
                raise RuntimeError("vLLM's own error")
            data = open(path, "rb").read()
            yield path, SimpleNamespace(nbytes=len(data))

    module.BaseModelLoader = BaseModelLoader
    module.safetensors_weights_iterator = safetensors_weights_iterator
    weights_hook._patch(module)
    return module


def engine(connector="KVLensConnector", extra=None):
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector=connector, kv_connector_extra_config=extra or {})
    )


def test_the_hook_hashes_during_a_kvlens_engines_load_only(tmp_path, cache_path):
    paths = shards(tmp_path / "ckpt")
    module = fake_loader_module()
    config = SimpleNamespace(files=paths)
    assert len(module.BaseModelLoader().load_model(engine("OffloadingConnector"), config)) == 3
    assert not os.path.exists(cache_path)
    assert len(module.safetensors_weights_iterator(paths, False).__next__()) == 2  # outside a load
    assert len(module.BaseModelLoader().load_model(engine(), config)) == 3
    assert fingerprint(str(tmp_path / "ckpt"), DigestCache(cache_path)).read_bytes == 0


def test_kvlens_inside_vllms_multiconnector_counts():
    def multi(*names):
        return engine("MultiConnector", {"connectors": [{"kv_connector": n} for n in names]})

    assert weights_hook.uses_kvlens(multi("NixlConnector", "KVLensConnector"))
    assert not weights_hook.uses_kvlens(multi("NixlConnector"))
    assert not weights_hook.uses_kvlens(SimpleNamespace(kv_transfer_config=None))


def test_a_read_along_that_cannot_start_leaves_the_load_whole_and_counts(tmp_path, cache_path, monkeypatch):
    paths = shards(tmp_path / "ckpt")

    def broken(*a, **k):
        raise OSError("no room")

    monkeypatch.setattr(read_along, "ReadAlong", broken)
    before = weights_hook.COUNTS["fallback"]
    module = fake_loader_module()
    assert len(module.BaseModelLoader().load_model(engine(), SimpleNamespace(files=paths))) == 3
    assert weights_hook.COUNTS["fallback"] == before + 1


def test_vllms_own_load_error_passes_through_and_nothing_is_remembered(tmp_path, cache_path):
    paths = shards(tmp_path / "ckpt")
    module = fake_loader_module(fail_after=1)
    with pytest.raises(RuntimeError, match="vLLM's own error"):
        module.BaseModelLoader().load_model(engine(), SimpleNamespace(files=paths))
    assert fingerprint(str(tmp_path / "ckpt"), DigestCache(cache_path)).cached_files == 0


def test_with_the_cache_off_nothing_is_installed(monkeypatch):
    monkeypatch.setenv(wd.ENV, "off")
    calls = []
    monkeypatch.setattr(weights_hook, "after_import", lambda *a: calls.append(a))
    weights_hook.install()
    assert calls == []


def test_the_hook_waits_for_the_module_it_wraps(tmp_path, monkeypatch):
    (tmp_path / "kvlens_hook_target.py").write_text("value = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    weights_hook.after_import("kvlens_hook_target", lambda m: setattr(m, "value", 2))
    import kvlens_hook_target

    assert kvlens_hook_target.value == 2
