"""The model's identity in every key: from the checkpoint's content and the settings that change
KV values, never from where the checkpoint lives."""

import json
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from connector.identity import weights_digests
from connector.identity.checkpoint import AdapterFingerprints, fingerprint
from connector.identity.weights_digests import DigestCache
from connector.vllm_compat import model_identity


@pytest.fixture(autouse=True)
def digest_cache_in_tmp(tmp_path, monkeypatch):
    """model_identity remembers digests in KVLENS_WEIGHTS_DIGESTS: never the user's home here."""
    path = tmp_path / "digest-cache" / "weights-digests.json"
    monkeypatch.setenv(weights_digests.ENV, str(path))
    return path


def checkpoint(folder, seed=0, shards=2, scale=1.0):
    """A small sharded safetensors checkpoint; ``seed`` and ``scale`` change values, not shapes."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    for shard in range(shards):
        tensors = {
            f"model.layers.{shard}.{name}": (rng.standard_normal((64, 32)) * scale).astype(np.float16)
            for name in ("q_proj", "k_proj", "v_proj", "o_proj")
        }
        save_file(tensors, os.path.join(folder, f"model-{shard:05d}-of-{shards:05d}.safetensors"))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        f.write('{"weight_map": {}}')
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"_name_or_path": str(folder)}, f)
    return str(folder)


def test_copies_at_other_paths_with_other_times_have_one_fingerprint(tmp_path):
    first = checkpoint(tmp_path / "host-a" / "llama")
    second = str(tmp_path / "host-b" / "snapshots" / "0123abcd")
    shutil.copytree(first, second)
    for name in os.listdir(second):
        os.utime(os.path.join(second, name), ns=(10**9, 10**9))  # copied years apart
    assert fingerprint(first) == fingerprint(second) is not None
    assert fingerprint(first).digest == fingerprint(second).digest


def test_a_fine_tune_with_the_same_names_shapes_and_sizes_has_another_fingerprint(tmp_path):
    base = fingerprint(checkpoint(tmp_path / "base"))
    tuned = fingerprint(checkpoint(tmp_path / "tuned", scale=1.001))  # every value nudged
    assert tuned.total_bytes == base.total_bytes and tuned.digest != base.digest


def test_replacing_one_tensor_in_place_changes_the_fingerprint(tmp_path):
    folder = checkpoint(tmp_path / "m")
    before = fingerprint(folder).digest
    path = os.path.join(folder, "model-00001-of-00002.safetensors")
    tensors = load_file(path)
    tensors["model.layers.1.v_proj"] = tensors["model.layers.1.v_proj"] + np.float16(0.5)
    save_file(tensors, path)  # same path, same size: only one tensor's values differ
    assert fingerprint(folder).digest != before


def test_the_fingerprint_reads_every_byte_once_and_then_remembers(tmp_path):
    folder = checkpoint(tmp_path / "m")
    cache_path = str(tmp_path / "cache" / "digests.json")
    first = fingerprint(folder, DigestCache(cache_path))
    assert first.files == 3 and first.read_bytes == first.total_bytes and first.cached_files == 0
    again = fingerprint(folder, DigestCache(cache_path))  # a restart: a new process, the same files
    assert again.digest == first.digest and again.read_bytes == 0 and again.cached_files == 3


def test_other_weight_formats_are_sampled_by_content(tmp_path):
    rng = np.random.default_rng(1)
    a, b, c = (tmp_path / d for d in "abc")
    for d in (a, b, c):
        d.mkdir()
    data = rng.bytes(3 << 20)
    (a / "pytorch_model.bin").write_bytes(data)
    (b / "pytorch_model.bin").write_bytes(data)
    (c / "pytorch_model.bin").write_bytes(rng.bytes(3 << 20))
    assert fingerprint(str(a)).digest == fingerprint(str(b)).digest != fingerprint(str(c)).digest


def test_a_folder_without_weights_has_no_fingerprint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert fingerprint(str(tmp_path)) is None


class HFConfig:
    def __init__(self, **values):
        self.__dict__.update(values)

    def to_dict(self):
        return dict(self.__dict__)


def vllm_config(
    model,
    quantization=None,
    cache_dtype="auto",
    dtype="torch.bfloat16",
    hf=None,
    max_model_len=4096,
    load=None,
    **config,
):
    hf = hf or HFConfig(_name_or_path=model, transformers_version="5.0", hidden_size=64, **config)
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model=model,
            revision=None,
            hf_config=hf,
            dtype=dtype,
            quantization=quantization,
            max_model_len=max_model_len,
        ),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        load_config=SimpleNamespace(**{"load_format": "auto", "download_dir": None, **(load or {})}),
    )


def test_the_identity_is_the_same_for_two_copies_and_names_what_changes_kv(tmp_path):
    first = checkpoint(tmp_path / "a")
    second = str(tmp_path / "b")
    shutil.copytree(first, second)
    one, two = model_identity(vllm_config(first)), model_identity(vllm_config(second))
    assert one == two and one.weights.startswith("ckpt:") and first not in one.key()
    assert model_identity(vllm_config(first, quantization="fp8")).key() != one.key()
    assert model_identity(vllm_config(first, cache_dtype="fp8_e4m3")).key() != one.key()
    assert model_identity(vllm_config(first, dtype="torch.float16")).key() != one.key()
    assert model_identity(vllm_config(first, rope_theta=1e6)).key() != one.key()  # e.g. hf_overrides


def test_an_operator_can_name_the_weights(tmp_path):
    a = model_identity(vllm_config(checkpoint(tmp_path / "a")), named="llama-8b@abc")
    b = model_identity(vllm_config(str(tmp_path / "elsewhere")), named="llama-8b@abc")
    assert a == b and a.weights == "named:llama-8b@abc"


def test_a_model_without_readable_weights_falls_back_to_its_name(tmp_path, caplog):
    identity = model_identity(vllm_config("org/not-downloaded"))
    assert identity.weights == "path:org/not-downloaded"
    assert "model_identity" in caplog.text


def test_a_lora_adapter_is_identified_by_its_content(tmp_path):
    adapters = AdapterFingerprints()
    one = checkpoint(tmp_path / "one", seed=5, shards=1)
    (tmp_path / "one" / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    copy = str(tmp_path / "copy")
    shutil.copytree(one, copy)
    other = checkpoint(tmp_path / "other", seed=6, shards=1)
    assert adapters.identity(one) == adapters.identity(copy)
    assert adapters.identity(one) != adapters.identity(other)
    (tmp_path / "copy" / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 32}')
    assert adapters.identity(copy) != adapters.identity(one)  # the same weights, scaled otherwise
    assert adapters.identity(str(tmp_path / "missing")) == f"lora-path:{tmp_path / 'missing'}"


def test_a_lora_request_keys_by_adapter_content_not_name(tmp_path):
    from .fakes import request, scheduler

    one = checkpoint(tmp_path / "one", seed=5, shards=1)
    other = checkpoint(tmp_path / "other", seed=6, shards=1)
    s = scheduler()

    def namespace(rid, name, path):
        lora = SimpleNamespace(lora_name=name, lora_int_id=1, lora_path=path)
        return s.prefix.policy(request(rid, [1, 2, 3], lora_request=lora)).namespace

    assert namespace("a", "x", one) == namespace("b", "y", one)  # one adapter, two names
    assert namespace("c", "x", one) != namespace("d", "x", other)  # a name re-pointed


def llama_like(folder, rows=1000):
    """One safetensors file with an embedding table and one layer, as a checkpoint holds them."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(3)
    tensors = {
        "model.embed_tokens.weight": rng.standard_normal((rows, 64)).astype(np.float16),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((rows, 64)).astype(np.float16),
        "model.layers.0.self_attn.k_proj.weight": rng.standard_normal((64, 64)).astype(np.float16),
    }
    path = os.path.join(folder, "model.safetensors")
    save_file(tensors, path)
    return str(folder), path


def retrain(path, name, rows):
    tensors = load_file(path)
    tensors[name][rows] += np.float16(0.25)
    save_file(tensors, path)  # same names, shapes, sizes and header: only those rows differ


def test_ten_retrained_embedding_rows_change_the_fingerprint(tmp_path):
    folder, path = llama_like(tmp_path / "m")
    before = fingerprint(folder).digest
    retrain(path, "model.embed_tokens.weight", slice(0, 10))  # special tokens' rows
    assert fingerprint(folder).digest != before


def test_the_first_hundred_rows_of_q_proj_changed_change_the_fingerprint(tmp_path):
    folder, path = llama_like(tmp_path / "m")
    before = fingerprint(folder).digest
    retrain(path, "model.layers.0.self_attn.q_proj.weight", slice(0, 100))
    assert fingerprint(folder).digest != before


def test_a_change_to_five_percent_of_a_bin_file_between_samples_changes_the_fingerprint(tmp_path):
    size = 32 << 20
    data = bytearray(np.random.default_rng(2).bytes(size))
    (tmp_path / "pytorch_model.bin").write_bytes(data)
    before = fingerprint(str(tmp_path)).digest
    # Where a sampling of the head and 16 evenly spaced 4 KiB ranges reads nothing.
    step = (size - (1 << 20)) // 16
    start = (1 << 20) + (step - 4096) // 2 + 4096 + 1
    data[start : start + size // 20] = bytes(size // 20)
    (tmp_path / "pytorch_model.bin").write_bytes(data)
    assert fingerprint(str(tmp_path)).digest != before


def test_a_file_larger_than_a_segment_is_hashed_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(weights_digests, "SEGMENT_BYTES", 1 << 20)
    data = bytearray(np.random.default_rng(4).bytes((5 << 20) + 123))
    (tmp_path / "model.gguf").write_bytes(data)
    first = fingerprint(str(tmp_path), threads=3)
    assert first.read_bytes == len(data) and fingerprint(str(tmp_path), threads=1).digest == first.digest
    data[-1] ^= 1  # the last byte of the last segment
    (tmp_path / "model.gguf").write_bytes(data)
    assert fingerprint(str(tmp_path)).digest != first.digest


def test_the_digest_cache_misses_when_a_file_changes_even_with_its_old_mtime(tmp_path):
    folder, path = llama_like(tmp_path / "m")
    cache_path = str(tmp_path / "digests.json")
    first = fingerprint(folder, DigestCache(cache_path))
    os.utime(path, ns=(10**9, 10**9))  # touched: hashed again, the same content
    touched = fingerprint(folder, DigestCache(cache_path))
    assert touched.cached_files == 0 and touched.read_bytes > 0 and touched.digest == first.digest
    old = os.stat(path).st_mtime_ns
    retrain(path, "model.embed_tokens.weight", slice(5, 6))
    os.utime(path, ns=(old, old))  # rewritten in place, its mtime put back
    changed = fingerprint(folder, DigestCache(cache_path))
    assert changed.cached_files == 0 and changed.digest != first.digest
    assert fingerprint(folder, DigestCache(cache_path)).cached_files == 1


def test_the_digest_cache_is_bounded_and_survives_a_damaged_file(tmp_path):
    cache_path = tmp_path / "digests.json"
    folders = [checkpoint(tmp_path / f"m{i}", seed=i, shards=1) for i in range(3)]
    for folder in folders:
        fingerprint(folder, DigestCache(str(cache_path), capacity=3))
    assert len(json.loads(cache_path.read_text())["files"]) == 3  # 6 files seen, the newest 3 kept
    cache_path.write_text("{not json")
    assert fingerprint(folders[0], DigestCache(str(cache_path))).read_bytes > 0  # hashed, not raised
    algorithm = weights_digests.ALGORITHM
    cache_path.write_text(json.dumps({"algorithm": algorithm, "files": {"x": ["0" * 32, "soon"], "y": 3}}))
    assert fingerprint(folders[0], DigestCache(str(cache_path))).read_bytes > 0
    assert len(json.loads(cache_path.read_text())["files"]) == 2  # only its two files, saved


def test_the_digest_cache_follows_the_setting(tmp_path, monkeypatch, digest_cache_in_tmp):
    first = checkpoint(tmp_path / "a")
    model_identity(vllm_config(first))
    assert digest_cache_in_tmp.exists()
    monkeypatch.setenv(weights_digests.ENV, "off")
    assert weights_digests.default_cache_path() is None
    monkeypatch.delenv(weights_digests.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert weights_digests.default_cache_path() == str(tmp_path / "xdg" / "kvlens" / "weights-digests.json")


def test_only_the_files_vllm_loads_are_hashed(tmp_path):
    folder = checkpoint(tmp_path / "m", shards=1)
    base = fingerprint(folder)
    (tmp_path / "m" / "pytorch_model.bin").write_bytes(b"x" * 1000)  # vLLM takes *.safetensors first
    os.makedirs(tmp_path / "m" / "original")
    (tmp_path / "m" / "original" / "consolidated.00.pth").write_bytes(b"y" * 1000)  # ignored by vLLM
    assert fingerprint(folder).digest == base.digest
    assert fingerprint(folder, load_format="pt").digest != base.digest  # a loader that reads .bin


def hub_snapshot(cache_dir, repo="org/tiny"):
    """A model as huggingface_hub lays it out under a cache folder (what --download-dir holds)."""
    root = cache_dir / ("models--" + repo.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    return checkpoint(root / "snapshots" / commit, shards=1)


def test_a_hub_model_under_download_dir_is_identified_by_content(tmp_path):
    snapshot = hub_snapshot(tmp_path / "downloads")
    identity = model_identity(vllm_config("org/tiny", load={"download_dir": str(tmp_path / "downloads")}))
    assert identity.weights == f"ckpt:{fingerprint(snapshot).digest}"


def test_dummy_weights_never_share_the_checkpoints_identity(tmp_path):
    folder = checkpoint(tmp_path / "m")
    real = model_identity(vllm_config(folder))
    dummy = model_identity(vllm_config(folder, load={"load_format": "dummy"}))
    assert dummy.weights == "dummy" and dummy.key() != real.key()


def phi3(**rope):
    from transformers import Phi3Config

    return Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        **rope,
    )


LONGROPE = {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}


def test_longrope_models_key_by_which_factors_max_model_len_selects(tmp_path):
    folder = checkpoint(tmp_path / "phi")

    def key(max_model_len, **rope):
        return model_identity(vllm_config(folder, hf=phi3(**rope), max_model_len=max_model_len)).key()

    assert key(4096, **LONGROPE) != key(32768, **LONGROPE)  # short factors, then long ones
    assert key(8192, **LONGROPE) == key(32768, **LONGROPE)  # long factors both
    assert key(2048, **LONGROPE) == key(4096, **LONGROPE)  # short factors both
    assert key(4096) == key(32768)  # plain RoPE: max_model_len changes no KV, engines share


def test_llama4_keys_by_attention_temperature_tuning(tmp_path):
    folder = checkpoint(tmp_path / "l4")

    def key(max_model_len, **tuned):
        config = vllm_config(folder, max_model_len=max_model_len, architectures=["Llama4ForCausalLM"])
        config.model_config.try_get_generation_config = lambda: dict(tuned)
        config.model_config.override_generation_config = {}
        return model_identity(config).key()

    assert key(8192) != key(65536)  # llama4.py: tuning on by default past 32K
    assert key(65536) == key(131072)
    assert key(8192, attn_temperature_tuning=True) == key(65536)


def test_engine_settings_that_change_attention_change_the_identity(tmp_path):
    folder = checkpoint(tmp_path / "m")
    base = model_identity(vllm_config(folder)).key()
    assert model_identity(vllm_config(folder, sliding_window=4096)).key() != base  # --disable-sliding-window
    causal = vllm_config(folder)
    causal.attention_config = SimpleNamespace(use_non_causal=True)
    assert model_identity(causal).key() != base
    skipped = vllm_config(folder)
    skipped.cache_config.kv_cache_dtype_skip_layers = ["0"]
    assert model_identity(skipped).key() != base
    online = vllm_config(folder)
    online.model_config.quantization_config = {"weight_block_size": [128, 128]}
    assert model_identity(online).key() != base
