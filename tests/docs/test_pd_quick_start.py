"""docs/disaggregation.md's quick start takes a new user from two YAML files to a streamed answer
through ``kvlens pd-proxy`` by copy and paste: its ports agree across the YAML files, the serve
commands, the proxy command and the request, and the proxy command and the ``curl`` as written
give a streamed answer from engines listening where the page says (stand-ins of vLLM here; the
real pair is tests/pd's)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import yaml

from tests.unit.pd_proxy_fakes import FakeEngine

from . import markdown as md

PAGE = md.DOCS / "disaggregation.md"


def _quick_start() -> tuple[list[dict], list[list[str]]]:
    """The quick start's YAML files (prefiller, decoder) and its shell commands, in order."""
    text = PAGE.read_text()
    start = text.index("## Quick start")
    end = text.index("\n## ", start + 1)
    blocks = [b for b in md.blocks(PAGE) if start < _offset(text, b.line) < end]
    configs = [yaml.safe_load(b.text) for b in blocks if b.lang == "yaml"]
    commands = [words for b in blocks if b.lang == "bash" for words in md.commands(b)]
    return configs, commands


def _offset(text: str, line: int) -> int:
    return len("\n".join(text.splitlines()[: line - 1]))


def _flag(words: list[str], name: str) -> str:
    return words[words.index(name) + 1]


def _parts() -> dict:
    (prefiller, decoder), commands = _quick_start()
    serves = [w for w in commands if "serve" in w]
    (proxy,) = [w for w in commands if w[:2] == ["kvlens", "pd-proxy"]]
    (curl,) = [w for w in commands if w[0] == "curl"]
    return {"prefiller": prefiller, "decoder": decoder, "serves": serves, "proxy": proxy, "curl": curl}


def test_the_quick_starts_ports_agree_from_the_yaml_files_to_the_request():
    p = _parts()
    prefiller_serve, decoder_serve = p["serves"]
    proxy = p["proxy"]
    assert "prefiller.yaml" in prefiller_serve[0] and "decoder.yaml" in decoder_serve[0]
    assert _flag(proxy, "--prefiller-port") == _flag(prefiller_serve, "--port")
    assert _flag(proxy, "--decoder-port") == _flag(decoder_serve, "--port")
    assert int(_flag(proxy, "--decoder-init-port")) == p["decoder"]["pd_peer_init_port"]
    assert int(_flag(proxy, "--decoder-alloc-port")) == p["decoder"]["pd_peer_alloc_port"]
    assert int(_flag(proxy, "--proxy-port")) == p["prefiller"]["pd_proxy_port"]
    assert _flag(proxy, "--proxy-host") == p["prefiller"]["pd_proxy_host"]
    assert f"localhost:{_flag(proxy, '--port')}/" in " ".join(p["curl"])


def test_the_quick_starts_proxy_and_request_as_written_give_a_streamed_answer():
    p = _parts()
    prefiller_port = int(_flag(p["proxy"], "--prefiller-port"))
    decoder_port = int(_flag(p["proxy"], "--decoder-port"))
    notices = f"tcp://{p['prefiller']['pd_proxy_host']}:{p['prefiller']['pd_proxy_port']}"
    engines = [
        FakeEngine("prefiller", notices, port=prefiller_port),
        FakeEngine("decoder", port=decoder_port),
    ]
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"}
    proxy = subprocess.Popen(p["proxy"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for engine in engines:
            engine.start()
        answer = _curl_when_up(p["curl"], proxy)
    finally:
        proxy.terminate()
        out, _ = proxy.communicate(timeout=30)
        for engine in engines:
            engine.stop()
    events = [line for line in answer.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) > 2, (answer, out)
    assert "prefiller notices within" not in out  # no request waited out the notify timeout
    decoded = engines[1].requests("/v1/completions")
    assert len(decoded) == 1 and decoded[0].body["stream"] is True


def _curl_when_up(curl: list[str], proxy: subprocess.Popen) -> str:
    deadline = time.monotonic() + 60
    while True:
        run = subprocess.run(curl, capture_output=True, text=True, timeout=60)
        if run.returncode == 0 and run.stdout:
            return run.stdout
        assert proxy.poll() is None, "kvlens pd-proxy exited"
        assert time.monotonic() < deadline, f"the proxy never answered: {run.stderr}"
        time.sleep(0.5)
