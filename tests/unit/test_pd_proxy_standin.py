"""The stand-in for LMCache's example PD proxy (tests/pd/lmcache_proxy_standin.py), run as a
script against fake engines: it speaks that proxy's protocol, and its wait has no bound."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .pd_proxy_fakes import Behaviour, FakeEngine, free_port, sse_events, tokens_of

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "pd" / "lmcache_proxy_standin.py"
PROMPT = "a prompt of several words for the stand in"


class StandIn:
    def __init__(self, prefill: Behaviour | None = None, ranks: int = 1):
        self.zport, self.port = free_port(), free_port()
        self.prefiller = FakeEngine("p", f"tcp://127.0.0.1:{self.zport}", prefill or Behaviour()).start()
        self.decoder = FakeEngine("d").start()
        self.init_ports = [free_port() for _ in range(ranks)]
        cmd = [sys.executable, str(SCRIPT), "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--prefiller-host", "127.0.0.1", "--prefiller-port", str(self.prefiller.port)]
        cmd += ["--decoder-host", "127.0.0.1", "--decoder-port", str(self.decoder.port)]
        cmd += ["--decoder-init-port", ",".join(map(str, self.init_ports))]
        cmd += ["--decoder-alloc-port", ",".join(str(p + 1) for p in self.init_ports)]
        cmd += ["--proxy-host", "127.0.0.1", "--proxy-port", str(self.zport)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30, trust_env=False)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the stand-in exited: {self.proc.stdout.read().decode()[-3000:]}")
            try:
                self.http.get("/docs")
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise TimeoutError("the stand-in did not start") from None
                time.sleep(0.1)

    def close(self):
        self.http.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.prefiller.stop()
        self.decoder.stop()


@pytest.fixture
def standin():
    made = []

    def make(**kw):
        s = StandIn(**kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def test_the_standin_speaks_lmcaches_protocol_for_completions(standin):
    s = standin(ranks=2)
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 4, "stream": True, "temperature": 0}
    events = sse_events(s.http.post("/v1/completions", json=body).text)
    assert [e["choices"][0]["text"] for e in events[:-1]] == [" t777", " d0", " d1", " d2"]
    assert events[-1] == "[DONE]"
    (pre,) = s.prefiller.requests("/v1/completions")
    tokens = tokens_of(PROMPT)
    assert pre.body["prompt"] == tokens and pre.body["max_tokens"] == 1 and pre.body["stream"] is False
    spec = pre.body["kv_transfer_params"]["disagg_spec"]
    assert pre.body["kv_transfer_params"]["ret_first_tok"] is True
    assert spec == {
        "req_id": "1",
        "receiver_host": "127.0.0.1",
        "receiver_init_port": s.init_ports,
        "receiver_alloc_port": [p + 1 for p in s.init_ports],
    }
    (dec,) = s.decoder.requests("/v1/completions")
    assert dec.body["prompt"] == [*tokens, 777] and dec.body["max_tokens"] == 3 and dec.body["stream"] is True
    assert "kv_transfer_params" not in dec.body
    assert dec.at >= max(t for _, t in s.prefiller.notified) and len(s.prefiller.notified) == 2


def test_the_standin_converts_the_decoders_chunks_for_chat(standin):
    s = standin()
    messages = [{"role": "user", "content": "hello there"}]
    body = {"model": "m", "messages": messages, "max_tokens": 3, "stream": True}
    events = sse_events(s.http.post("/v1/chat/completions", json=body).text)
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas == [
        {"role": "assistant", "content": ""},
        {"content": " t777"},
        {"content": " d0"},
        {"content": " d1"},
    ]
    (tok,) = s.prefiller.requests("/tokenize")
    assert tok.body == {"messages": messages}


def test_the_standins_wait_has_no_bound(standin):
    """As LMCache's proxy: without the notification the decoder is never asked (the proxy would
    wait forever); once it comes, the answer completes."""
    s = standin(prefill=Behaviour(notify="on_release"))
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 3, "stream": True}
    with s.http.stream("POST", "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        head = next(ln for ln in lines if ln.startswith("data:"))
        assert json.loads(head[5:])["choices"][0]["text"] == " t777"
        waited = time.monotonic()
        while time.monotonic() - waited < 8:  # longer than kvlens pd-proxy's bound (5 s by default)
            assert s.decoder.seen == [], "the stand-in asked the decoder without the notification"
            time.sleep(0.2)
        s.prefiller.b.release.set()
        rest = list(lines)
    assert rest[-1] == "data: [DONE]" or "data: [DONE]" in rest
    (dec,) = s.decoder.requests("/v1/completions")
    assert dec.at >= s.prefiller.notified[0][1]


def test_kvlens_pd_proxy_takes_every_flag_of_lmcaches_proxy_with_its_default():
    import importlib.util

    from connector.ops.cli import parser

    spec = importlib.util.spec_from_file_location("lmcache_proxy_standin", SCRIPT)
    standin_module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = standin_module  # its dataclasses look themselves up there
    spec.loader.exec_module(standin_module)
    theirs = vars(standin_module.parse_args([]))
    ours = vars(parser().parse_args(["pd-proxy"]))
    assert {k: ours[k] for k in theirs} == theirs
    argv = ["--port", "1", "--host", "h", "--prefiller-host", "a,b", "--prefiller-port", "2,3"]
    argv += [
        "--num-prefillers",
        "2",
        "--decoder-host",
        "c",
        "--decoder-port",
        "4",
        "--decoder-init-port",
        "5,6",
    ]
    argv += ["--decoder-alloc-port", "7,8", "--num-decoders", "3", "--proxy-host", "i", "--proxy-port", "9"]
    theirs = vars(standin_module.parse_args(argv))
    ours = vars(parser().parse_args(["pd-proxy", *argv]))
    assert {k: ours[k] for k in theirs} == theirs
