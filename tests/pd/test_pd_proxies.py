"""1P1D behind the two proxies a user runs, on the shared pair: LMCache's example proxy (our
stand-in, as a script with its own flags) and ``kvlens pd-proxy``. Completions and chat, streamed:
greedy outputs equal the plain instance's, and the decoder computed none of the prompt tokens it
was sent (vLLM's own counters). ``kvlens pd-proxy`` also: one trace over proxy, prefiller and
decoder, a per-request record with the three-way split and the decoder's ``kvlens.pd``, and the
phase histograms on its /metrics.

Both proxies bind the prefiller's pd_proxy_port, lent by the pair for the test (no new engine)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.telemetry.serve import base_env, free_port, sum_samples, traceparent, wait_until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
STANDIN = REPO / "tests" / "pd" / "lmcache_proxy_standin.py"
MAX_TOKENS = 6
WORDS = "alpha beta gamma delta kernel cache block token prefill decode proxy river stone cloud".split()


def text_prompt(words: int, seed: int) -> str:
    """Deterministic English-like text (a few chunks of the tiny model's tokens)."""
    x, out = seed * 7919 + 3, []
    for _ in range(words):
        x = (x * 1103515245 + 12345) % (2**31)
        out.append(WORDS[x % len(WORDS)])
    return " ".join(out)


class Proxy:
    """A proxy process (its own session) on a free port; stopped by ``close``."""

    def __init__(self, cmd: list[str], log: Path, ready_path: str, env: dict[str, str]) -> None:
        self.port = free_port()
        self.log = log
        self._out = open(log, "wb")
        cmd = [*cmd, "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=120, trust_env=False)
        deadline = time.monotonic() + 90
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the proxy exited: {self.log.read_text(errors='replace')[-3000:]}")
            try:
                if self.http.get(ready_path).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the proxy did not start: {self.log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)

    def close(self) -> None:
        self.http.close()
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(15)
        self._out.close()

    def stream(self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> str:
        """The text of a streamed answer (completions' ``text`` or chat's ``delta.content``)."""
        resp = self.http.post(path, json={**body, "stream": True}, headers=headers or {})
        assert resp.status_code == 200, resp.text[-2000:]
        return streamed_text(resp.text)


def streamed_text(raw: str) -> str:
    text = []
    for event in raw.split("\n\n"):
        event = event.strip()
        if not event.startswith("data: ") or event == "data: [DONE]":
            continue
        data = json.loads(event[6:])
        assert "error" not in data, data
        for choice in data.get("choices") or []:
            text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(text)


def proxy_flags(pair, zport: int) -> list[str]:
    return [
        *("--prefiller-host", "127.0.0.1", "--prefiller-port", str(pair.prefiller.port)),
        *("--decoder-host", "127.0.0.1", "--decoder-port", str(pair.decoder.port)),
        *("--decoder-init-port", ",".join(map(str, pair.init_ports))),
        *("--decoder-alloc-port", ",".join(map(str, pair.alloc_ports))),
        *("--proxy-host", "127.0.0.1", "--proxy-port", str(zport)),
    ]


def completion(prompt: str) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
    }


def chat(prompt: str) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt}]
    return {
        "model": "tiny",
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
    }


def plain_text(pair, path: str, body: dict[str, Any]) -> str:
    answer = pair.plain.post(path, body)["choices"][0]
    return answer["text"] if "text" in answer else answer["message"]["content"]


def prompt_length(pair, body: dict[str, Any]) -> int:
    asked = {
        "model": "tiny",
        **({"messages": body["messages"]} if "messages" in body else {"prompt": body["prompt"]}),
    }
    return len(pair.plain.post("/tokenize", asked)["tokens"])


def decoder_sources(pair) -> dict[str, float]:
    samples = pair.decoder.samples()
    return {
        "p2p": sum_samples(samples, "vllm:prompt_tokens_cached_by_source_total", source="p2p"),
        "computed": sum_samples(samples, "vllm:prompt_tokens_by_source_total", source="local_compute"),
    }


def through(pair, proxy: Proxy, requests: list[tuple[str, dict[str, Any]]]) -> None:
    """Each request streamed through ``proxy``: the plain instance's text, and the decoder loaded
    every prompt token the prefiller computed and computed only the token the prefiller added."""
    before = decoder_sources(pair)
    sent = 0
    for path, body in requests:
        length = prompt_length(pair, body)
        assert 256 < length < 1024, length  # a few chunks, inside the decoder's buffer
        sent += length
        assert proxy.stream(path, body) == plain_text(pair, path, body), (path, length)
    want = {"p2p": sent, "computed": len(requests)}

    def moved() -> dict[str, float] | None:
        now = decoder_sources(pair)
        delta = {k: now[k] - before[k] for k in now}
        return delta if delta == want else None

    try:
        wait_until(moved, timeout=30, what="the decoder's prompt token counters")
    except TimeoutError:
        now = decoder_sources(pair)
        pytest.fail(f"decoder tokens { ({k: now[k] - before[k] for k in now}) }, want {want}")


def test_lmcaches_proxy_unchanged_serves_1p1d_with_the_plain_output_and_no_recompute(pd_pair, tmp_path):
    with pd_pair.proxy_port_lent() as zport:
        proxy = Proxy(
            [sys.executable, str(STANDIN), *proxy_flags(pd_pair, zport)],
            tmp_path / "standin.log",
            "/docs",
            base_env(),
        )
        try:
            through(
                pd_pair,
                proxy,
                [
                    ("/v1/completions", completion(text_prompt(160, seed=1))),
                    ("/v1/chat/completions", chat(text_prompt(200, seed=2))),
                ],
            )
        finally:
            proxy.close()
    assert pd_pair.idle() == {"entries": 0, "used": 0, "receiving": 0, "sending": 0}


def phase_counts(metrics: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics):
        for s in family.samples:
            if s.name == "kvlens_pd_proxy_phase_seconds_count":
                counts[s.labels["phase"]] = counts.get(s.labels["phase"], 0) + s.value
    return counts


def test_kvlens_pd_proxy_serves_1p1d_in_one_trace_with_records_and_phase_metrics(pd_pair, tmp_path):
    env = base_env(
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=pd_pair.spans.endpoint,
        OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf",
        OTEL_SERVICE_NAME="kvlens-pd-proxy",
        OTEL_BSP_SCHEDULE_DELAY="200",
    )
    with pd_pair.proxy_port_lent() as zport:
        proxy = Proxy(
            [sys.executable, "-m", "connector.ops.cli", "pd-proxy", *proxy_flags(pd_pair, zport)],
            tmp_path / "pd-proxy.log",
            "/health",
            env,
        )
        try:
            through(
                pd_pair,
                proxy,
                [
                    ("/v1/completions", completion(text_prompt(170, seed=3))),
                    ("/v1/chat/completions", chat(text_prompt(190, seed=4))),
                ],
            )
            trace_id = "5ce0e9a56015fec5aadfa328ae398115"
            traced = completion(text_prompt(150, seed=5))
            text = proxy.stream("/v1/completions", traced, {"traceparent": traceparent(trace_id)})
            assert text == plain_text(pd_pair, "/v1/completions", traced)
            whole = completion(text_prompt(180, seed=6))  # not streamed: the decoder's kvlens.pd is known
            answer = proxy.http.post("/v1/completions", json=whole).json()
            assert answer["choices"][0]["text"] == plain_text(pd_pair, "/v1/completions", whole)
            records = proxy.http.get("/kvlens/pd/requests", params={"limit": 10}).json()["requests"]
            metrics = proxy.http.get("/metrics").text
        finally:
            proxy.close()

    assert len(records) == 4 and all(r["outcome"] == "ok" for r in records), records
    streamed = next(r for r in records if r["trace_id"] == trace_id)
    assert streamed["prompt_tokens"] == prompt_length(pd_pair, traced)
    split = ("prefill_ms", "transfer_wait_ms", "decode_first_token_ms")
    assert all(streamed[k] is not None and streamed[k] >= 0 for k in (*split, "ttft_ms")), json.dumps(
        streamed
    )
    assert streamed["prefill_ms"] > 0 and streamed["decode_first_token_ms"] > 0, json.dumps(streamed)
    assert sum(streamed[k] for k in split) <= streamed["ttft_ms"] + 1.0, streamed
    joined = records[0]  # newest first
    assert joined["stream"] is False and joined["prompt_tokens"] == prompt_length(pd_pair, whole)
    pd = joined["decoder_pd"]
    assert pd["role"] == "receiver" and pd["outcome"] == "loaded", joined
    assert pd["tokens"] == joined["prompt_tokens"] and pd["bytes"] > 0 and pd["transfer_ms"] > 0

    counts = phase_counts(metrics)
    assert all(counts.get(p, 0) >= 3 for p in ("prefill", "transfer_wait", "decode_first_token", "ttft")), (
        counts
    )

    names = {"kvlens.pd.proxy", "kvlens.pd.send", "kvlens.pd.receive"}
    spans = pd_pair.spans.wait_for(
        lambda s: names <= {x.name for x in s if x.trace_id == trace_id}, timeout=60
    )
    mine = [s for s in spans if s.trace_id == trace_id]
    send = next(s for s in mine if s.name == "kvlens.pd.send")
    receive = next(s for s in mine if s.name == "kvlens.pd.receive")
    assert send.attributes["kvlens.pd.req_id"] == streamed["req_id"]
    assert (
        send.attributes["kvlens.pd.outcome"] == "ok" and receive.attributes["kvlens.pd.outcome"] == "loaded"
    )
    assert pd_pair.idle() == {"entries": 0, "used": 0, "receiving": 0, "sending": 0}
