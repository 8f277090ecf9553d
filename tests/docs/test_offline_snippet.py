"""The README's offline ``LLM(...)`` snippet runs as a user would run it, on the tiny model: one
vLLM engine for this module."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.telemetry.serve import base_env

from . import markdown as md

pytestmark = pytest.mark.integration

RUN_TIMEOUT_S = 300


def offline_snippets() -> list[md.Block]:
    return [b for b in md.all_blocks() if b.lang == "python" and "LLM(" in b.text]


def test_the_docs_show_one_offline_snippet():
    assert [b.path for b in offline_snippets()] == [md.README]


def test_the_offline_snippet_runs_with_kvlens_on_the_tiny_model(tiny_model, tmp_path):
    snippet = offline_snippets()[0].text
    assert snippet.count('model="MODEL",') == 1
    # enforce_eager skips vLLM's torch.compile warm-up (45 s on a cold cache on 2 cores): that
    # is vLLM's start-up, not what the snippet shows. Everything else runs as written.
    script = tmp_path / "offline.py"
    script.write_text(snippet.replace('model="MODEL",', f"model={tiny_model!r}, enforce_eager=True,"))
    out = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        # base_env puts this repository on PYTHONPATH (as `pip install -e .` does for users);
        # vLLM's log goes to stderr so that stdout holds only what the snippet prints.
        env=base_env(VLLM_LOGGING_STREAM="ext://sys.stderr"),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "KVLens scheduler ready" in out.stderr and "KVLens worker ready" in out.stderr, log[-4000:]
    assert out.stdout.strip(), "the snippet prints the generated text"
