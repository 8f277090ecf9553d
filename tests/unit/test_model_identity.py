"""The model's identity in every key: from the checkpoint's content and the settings that change
KV values, never from where the checkpoint lives."""

import json
import os
import shutil
from types import SimpleNamespace

import numpy as np
from safetensors.numpy import save_file

from connector.checkpoint_identity import AdapterFingerprints, fingerprint
from connector.vllm_compat import model_identity


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
    from safetensors.numpy import load_file

    tensors = load_file(path)
    tensors["model.layers.1.v_proj"] = tensors["model.layers.1.v_proj"] + np.float16(0.5)
    save_file(tensors, path)  # same path, same size: only one tensor's values differ
    assert fingerprint(folder).digest != before


def test_the_fingerprint_reads_little_of_the_checkpoint(tmp_path):
    found = fingerprint(checkpoint(tmp_path / "m"))
    assert found.files == 3 and found.read_bytes < found.total_bytes / 4


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
        self.values = values

    def to_dict(self):
        return dict(self.values)


def vllm_config(model, quantization=None, cache_dtype="auto", dtype="torch.bfloat16", **config):
    hf = HFConfig(_name_or_path=model, transformers_version="5.0", hidden_size=64, **config)
    return SimpleNamespace(
        model_config=SimpleNamespace(
            model=model, revision=None, hf_config=hf, dtype=dtype, quantization=quantization
        ),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
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
