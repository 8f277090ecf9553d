"""``--real``: the serving benchmarks on the real model (bench/lib/models.py, served.py). Fast: no vLLM."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from bench.lib import models
from bench.lib.modes import parse_modes

REAL_CONFIG = {
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
}


def make_model(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(REAL_CONFIG))
    (path / "model.safetensors").write_bytes(b"")
    (path / "tokenizer.json").write_text("{}")
    return path


def test_the_real_model_is_where_the_environment_says(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLENS_REAL_MODEL", str(tmp_path / "m"))
    assert models.real_model_dir() == tmp_path / "m"
    monkeypatch.delenv("KVLENS_REAL_MODEL")
    monkeypatch.setenv("KVLENS_RUN_DIR", str(tmp_path / "run"))
    assert models.real_model_dir() == tmp_path / "run" / "smollm2-135m"


def test_a_real_model_being_recreated_is_waited_for(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLENS_REAL_MODEL", str(tmp_path / "m"))
    timer = threading.Timer(0.3, make_model, [tmp_path / "m"])
    timer.start()
    try:
        assert models.real_model(wait_s=20) == tmp_path / "m"
    finally:
        timer.cancel()


def test_a_missing_real_model_stops_the_run_saying_how_to_make_it(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLENS_REAL_MODEL", str(tmp_path / "absent"))
    with pytest.raises(SystemExit, match="setup.sh"):
        models.real_model(wait_s=0.1)


def test_kv_size_and_context_come_from_the_checkpoint(tmp_path):
    model = make_model(tmp_path / "m")
    assert models.kv_bytes_per_token(model) == 30 * 2 * 3 * 64 * 2  # 23,040 bytes
    models.check_fits(model, 8192)
    with pytest.raises(SystemExit, match="8192"):
        models.check_fits(model, 8193)


def test_real_runs_write_results_of_their_own_and_refuse_a_second_model(tmp_path, monkeypatch):
    from bench.ttft_peers import TtftPeers

    monkeypatch.setenv("KVLENS_REAL_MODEL", str(make_model(tmp_path / "m")))
    bench = TtftPeers(TtftPeers.parse_args(["--real", "--out", str(tmp_path)]))
    assert bench.model == tmp_path / "m" and bench.vocab == 49152
    assert bench.out_paths()[0] == tmp_path / "ttft_peers-real.json"
    with pytest.raises(SystemExit, match="two models"):
        TtftPeers(TtftPeers.parse_args(["--real", "--model", str(tmp_path / "m")]))


def test_the_full_prefill_mode_turns_prefix_caching_off():
    (full, none) = parse_modes("full,none", "cpu")
    assert not full.prefix_caching and full.connector is None
    assert none.prefix_caching
