"""Two hosts share KV through one Redis as users deploy them: each `vllm serve` loads its own copy
of the same checkpoint, at another path with other file times (a hub snapshot on one host, a
copy on the other). A fine-tune with the same names, shapes and sizes never gets a hit, and is told
the model differs."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ..telemetry.serve import prompt_tokens
from .test_serve_remote import (
    loaded,
    remote_only,
    serve,
    serve_together,
    served_from_redis,
    text,
    writes_landed,
)

pytestmark = pytest.mark.integration


def copy_checkpoint(source: str, dest: str, mtime_s: int) -> str:
    shutil.copytree(source, dest)
    for name in os.listdir(dest):
        os.utime(os.path.join(dest, name), (mtime_s, mtime_s))
    return dest


def fine_tune(source: str, dest: str) -> str:
    """The same files, tensor names, dtypes and shapes; every weight nudged."""
    shutil.copytree(source, dest)
    path = os.path.join(dest, "model.safetensors")
    torch.manual_seed(7)
    tuned = {n: (t.float() + 0.02 * torch.randn(t.shape)).to(t.dtype) for n, t in load_file(path).items()}
    save_file(tuned, path)
    return dest


def test_copies_of_a_checkpoint_on_two_hosts_share_through_redis_and_a_fine_tune_does_not(
    redis_server, tiny_model, tmp_path
):
    host_a = copy_checkpoint(
        tiny_model, str(tmp_path / "host-a" / "models--tiny" / "snapshots" / "1f2e"), 10**9
    )
    host_b = copy_checkpoint(tiny_model, str(tmp_path / "host-b" / "opt" / "tiny-copy"), 2 * 10**9)
    tuned = fine_tune(tiny_model, str(tmp_path / "host-c" / "tiny-tuned"))
    kv = remote_only(redis_server.url, remote_key_prefix="two-hosts")
    prompt = prompt_tokens(700, 31)

    first = serve(host_a, tmp_path, "host-a", kv)
    try:
        cold = first.complete(prompt, max_tokens=8)
        assert loaded(cold) == {}
        writes_landed(first)
    finally:
        first.stop()

    # The second host and the fine-tune start together: both only read what the first stored.
    second, third = serve_together(tmp_path, ("host-b", host_b, kv), ("host-c", tuned, kv))
    try:
        # all from Redis, with what vLLM computed for the whole prompt on the first host
        served_from_redis(second, prompt, cold)

        other = third.complete(prompt, max_tokens=8)
        assert loaded(other) == {}
        kvlens = other["kv_transfer_params"]["kvlens"]  # the first host's marks in Redis say why
        assert kvlens["miss_reason"] == "other_namespace" and kvlens["miss_detail"] == {
            "differs_in": ["model"]
        }
        assert text(other) != text(cold)  # it is another model
    finally:
        second.stop()
        third.stop()
