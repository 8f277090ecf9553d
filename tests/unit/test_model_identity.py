import os

from connector.vllm_compat import weights_fingerprint


def test_replacing_the_checkpoint_at_the_same_path_changes_the_fingerprint(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x" * 100)
    (tmp_path / "tokenizer.json").write_text("{}")
    before = weights_fingerprint(str(tmp_path), '{"hidden_size": 256}')
    assert before == weights_fingerprint(str(tmp_path), '{"hidden_size": 256}')  # stable
    (tmp_path / "tokenizer.json").write_text('{"a": 1}')  # not the weights
    assert weights_fingerprint(str(tmp_path), '{"hidden_size": 256}') == before
    weights.write_bytes(b"y" * 100)  # same size, newer file
    os.utime(weights, ns=(1, os.stat(weights).st_mtime_ns + 10**9))
    after = weights_fingerprint(str(tmp_path), '{"hidden_size": 256}')
    assert after != before
    assert weights_fingerprint(str(tmp_path), '{"hidden_size": 512}') != after  # config / overrides
    assert weights_fingerprint(str(tmp_path), '{"hidden_size": 256}', "overrides") != after
