"""``kvlens pd-proxy`` against fake engines: LMCache's protocol towards the prefiller and the
decoder, the bounded wait, errors surfaced to the client, round-robin, the trace passed on,
metrics and per-request records."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from connector.ops.cli import main as cli_main
from connector.pd_proxy.backends import ProxySettings
from connector.pd_proxy.observe import parse_traceparent
from connector.pd_proxy.server import PDProxy, build_app

from .pd_proxy_fakes import Behaviour, FakeEngine, ServedApp, free_port, sse_events, tokens_of

PROMPT = "the quick brown fox jumps over the lazy dog"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


class Setup:
    def __init__(
        self, tmp_path, prefillers=1, decoders=1, ranks=1, prefill=None, decode=None, provider=None, **kw
    ):
        self.zport = free_port()
        notify = f"tcp://127.0.0.1:{self.zport}"
        self.prefillers = [
            FakeEngine(f"p{i}", notify, prefill or Behaviour()).start() for i in range(prefillers)
        ]
        self.decoders = [FakeEngine(f"d{i}", None, decode or Behaviour()).start() for i in range(decoders)]
        self.init_ports = [free_port() for _ in range(ranks)]
        self.log = tmp_path / "requests.jsonl"
        self.settings = ProxySettings(
            host="127.0.0.1",
            port=free_port(),
            prefiller_host=["127.0.0.1"],
            prefiller_port=[e.port for e in self.prefillers],
            num_prefillers=prefillers,
            decoder_host=["127.0.0.1"],
            decoder_port=[e.port for e in self.decoders],
            decoder_init_port=self.init_ports,
            decoder_alloc_port=[p + 1 for p in self.init_ports],
            num_decoders=decoders,
            proxy_host="127.0.0.1",
            proxy_port=self.zport,
            request_log=str(self.log),
            **kw,
        )
        self.proxy = PDProxy(self.settings, provider, CollectorRegistry())
        self.app = ServedApp(build_app(self.proxy), self.settings.port).start()
        self.http = httpx.Client(base_url=self.app.url, timeout=30, trust_env=False)

    def close(self):
        self.http.close()
        self.app.stop()
        for e in self.prefillers + self.decoders:
            e.stop()

    def post(self, path, body, **kw):
        return self.http.post(path, json=body, **kw)

    def records(self):
        return self.http.get("/kvlens/pd/requests", params={"limit": 100}).json()["requests"]

    def metric(self, name, **labels):
        text = self.http.get("/metrics").text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return None


@pytest.fixture
def setup(tmp_path):
    made = []

    def make(**kw):
        s = Setup(tmp_path, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def completion(stream, max_tokens=5, **extra):
    return {
        "model": "m",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "stream": stream,
        "temperature": 0,
        **extra,
    }


def chat(stream, max_tokens=4):
    messages = [{"role": "user", "content": "say hello to the fox"}]
    return {"model": "m", "messages": messages, "max_tokens": max_tokens, "stream": stream, "temperature": 0}


def test_streamed_completion_is_the_prefillers_token_then_the_decoders_rest(setup):
    s = setup(ranks=2)
    resp = s.post("/v1/completions", completion(True, 5))
    assert resp.status_code == 200
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    texts = [e["choices"][0]["text"] for e in events[:-1]]
    assert texts == [" t777", " d0", " d1", " d2", " d3"]
    assert len({e["id"] for e in events[:-1]}) == 1  # one answer, one id
    tokens = tokens_of(PROMPT)
    (pre,) = s.prefillers[0].requests("/v1/completions")
    assert pre.body["prompt"] == tokens and pre.body["max_tokens"] == 1 and pre.body["stream"] is False
    params = pre.body["kv_transfer_params"]
    assert params["ret_first_tok"] is True
    spec = params["disagg_spec"]
    assert spec["receiver_host"] == "127.0.0.1"
    assert spec["receiver_init_port"] == s.init_ports and spec["receiver_alloc_port"] == [
        p + 1 for p in s.init_ports
    ]
    (dec,) = s.decoders[0].requests("/v1/completions")
    assert dec.body["prompt"] == [*tokens, 777] and dec.body["max_tokens"] == 4 and dec.body["stream"] is True
    assert "kv_transfer_params" not in dec.body and dec.body["temperature"] == 0
    # both ranks' notifications arrived before the decoder was asked
    assert [r for r, _ in s.prefillers[0].notified] == [spec["req_id"]] * 2
    assert dec.at >= max(t for _, t in s.prefillers[0].notified)
    (rec,) = s.records()
    assert rec["outcome"] == "ok" and rec["notifications"] == "2/2" and rec["req_id"] == spec["req_id"]
    assert rec["prompt_tokens"] == len(tokens) and rec["ttft_ms"] >= rec["prefill_ms"] > 0
    assert rec["transfer_wait_ms"] is not None and rec["decode_first_token_ms"] is not None


def test_non_streaming_completion_is_one_json_answer_with_the_clients_usage(setup):
    s = setup()
    resp = s.post("/v1/completions", completion(False, 4))
    assert resp.status_code == 200
    answer = resp.json()
    assert answer["object"] == "text_completion" and answer["choices"][0]["text"] == " t777 d0 d1 d2"
    n = len(tokens_of(PROMPT))
    assert answer["usage"]["prompt_tokens"] == n and answer["usage"]["completion_tokens"] == 4
    assert answer["id"].startswith("cmpl-p0")
    (dec,) = s.decoders[0].requests("/v1/completions")
    assert dec.body["stream"] is False and dec.body["max_tokens"] == 3
    (rec,) = s.records()
    assert rec["outcome"] == "ok" and rec["decoder_pd"]["outcome"] == "loaded"


def test_streamed_chat_is_chat_chunks_from_completion_chunks(setup):
    s = setup()
    resp = s.post("/v1/chat/completions", chat(True, 3))
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]" and all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    contents = [e["choices"][0]["delta"]["content"] for e in events[1:-1]]
    assert contents == [" t777", " d0", " d1"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    (tok,) = s.prefillers[0].requests("/tokenize")
    assert tok.body["messages"][0]["content"] == "say hello to the fox"
    (pre,) = s.prefillers[0].requests("/v1/completions")
    assert "messages" not in pre.body and pre.body["prompt"] == tokens_of(
        "user: say hello to the fox assistant:"
    )


def test_non_streaming_chat_is_one_chat_answer(setup):
    s = setup()
    answer = s.post("/v1/chat/completions", chat(False, 3)).json()
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": " t777 d0 d1"}


@pytest.mark.parametrize(
    "behaviour", [Behaviour(notify="never"), Behaviour(notify_ranks=1)], ids=["none", "one_of_two"]
)
def test_missing_notifications_end_the_wait_at_its_bound_and_the_decoder_is_still_asked(
    setup, behaviour, caplog
):
    s = setup(
        ranks=2, prefill=behaviour, notify_timeout_s=2.0
    )  # the one that comes: in time even on a busy machine
    t0 = time.monotonic()
    resp = s.post("/v1/completions", completion(True, 3))
    assert resp.status_code == 200 and time.monotonic() - t0 < 20
    assert [e["choices"][0]["text"] for e in sse_events(resp.text)[:-1]] == [" t777", " d0", " d1"]
    assert len(s.decoders[0].requests("/v1/completions")) == 1
    (rec,) = s.records()
    assert rec["outcome"] == "notify_timeout" and rec["transfer_wait_ms"] >= 2000
    assert rec["notifications"] == ("0/2" if behaviour.notify == "never" else "1/2")
    assert s.metric("kvlens_pd_proxy_wait_timeouts_total") == 1
    assert s.metric("kvlens_pd_proxy_requests_total", outcome="notify_timeout") == 1
    # the proxy says why it waited, and where the notices should come
    (said,) = [r.getMessage() for r in caplog.records if "prefiller notices within" in r.getMessage()]
    assert "--proxy-port" in said and "pd_proxy_port" in said and "kvlens doctor" in said


def test_a_notification_after_the_prefillers_answer_is_waited_for(setup):
    s = setup(prefill=Behaviour(notify="on_release"))
    with s.http.stream("POST", "/v1/completions", json=completion(True, 3)) as resp:
        lines = resp.iter_lines()
        head = next(ln for ln in lines if ln.startswith("data:"))
        assert json.loads(head[5:])["choices"][0]["text"] == " t777"
        assert s.decoders[0].requests("/v1/completions") == []
        s.prefillers[0].b.release.set()
        rest = "\n\n".join(lines)
    assert rest.strip().endswith("data: [DONE]")
    (dec,) = s.decoders[0].requests("/v1/completions")
    assert dec.at >= s.prefillers[0].notified[0][1]
    assert s.records()[0]["outcome"] == "ok"


def test_a_prefiller_error_reaches_the_client_with_its_status_and_nothing_waits(setup):
    s = setup(prefill=Behaviour(prefill_status=500))
    for stream in (False, True):
        resp = s.post("/v1/completions", completion(stream))
        assert resp.status_code == 500 and resp.json()["error"]["message"] == "fake prefill failure"
    assert s.decoders[0].seen == [] and s.proxy.board.waiting == 0
    assert [r["outcome"] for r in s.records()] == ["prefill_failed", "prefill_failed"]
    assert s.metric("kvlens_pd_proxy_in_flight") == 0


def test_an_unreachable_prefiller_is_a_502(setup):
    s = setup()
    s.prefillers[0].stop()
    resp = s.post("/v1/completions", completion(False))
    assert resp.status_code == 502 and "unreachable" in resp.json()["error"]["message"]
    assert s.records()[0]["outcome"] == "tokenize_failed"


def test_a_decoder_killed_mid_stream_ends_the_clients_stream_with_an_error(setup):
    s = setup(decode=Behaviour(decode_die_after=2))
    t0 = time.monotonic()
    resp = s.post("/v1/completions", completion(True, 8))
    assert time.monotonic() - t0 < 20
    events = sse_events(resp.text)
    assert [e["choices"][0]["text"] for e in events[:3]] == [" t777", " d0", " d1"]
    assert "error" in events[-2] and events[-1] == "[DONE]"
    (rec,) = s.records()
    assert rec["outcome"] == "decode_failed" and s.decoders[0].b.decode_die_after == 2


def test_a_decoder_error_status_reaches_a_non_streaming_client(setup):
    s = setup(decode=Behaviour(decode_status=400))
    resp = s.post("/v1/completions", completion(False))
    assert resp.status_code == 400 and resp.json()["error"]["message"] == "fake decode failure"
    events = sse_events(s.post("/v1/completions", completion(True)).text)
    assert events[-2]["error"]["message"] == "fake decode failure" and events[-1] == "[DONE]"
    assert [r["outcome"] for r in s.records()] == ["decode_failed", "decode_failed"]


def test_requests_go_round_robin_over_prefillers_and_decoders(setup):
    s = setup(prefillers=2, decoders=3)
    for _ in range(6):
        assert s.post("/v1/completions", completion(False, 2)).status_code == 200
    assert [len(e.requests("/v1/completions")) for e in s.prefillers] == [3, 3]
    assert [len(e.requests("/v1/completions")) for e in s.decoders] == [2, 2, 2]
    pairs = {(r["prefiller"], r["decoder"]) for r in s.records()}
    assert len(pairs) == 6  # n mod 2 and n mod 3: every pair once


def _trace_ids(engine, path):
    return [
        parse_traceparent(r.headers.get("traceparent") or r.headers.get("Traceparent"))
        for r in engine.requests(path)
    ]


def test_the_clients_traceparent_reaches_prefiller_and_decoder(setup):
    s = setup()
    tp = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"
    assert s.post("/v1/completions", completion(True, 3), headers={"traceparent": tp}).status_code == 200
    (pre,), (dec,) = (
        _trace_ids(s.prefillers[0], "/v1/completions"),
        _trace_ids(s.decoders[0], "/v1/completions"),
    )
    assert pre[0] == dec[0] == CLIENT_TRACE
    assert s.records()[0]["trace_id"] == CLIENT_TRACE


def test_without_a_client_trace_the_proxy_starts_one_shared_by_both_backends(setup):
    s = setup()
    s.post("/v1/completions", completion(False, 3))
    (pre,), (dec,) = (
        _trace_ids(s.prefillers[0], "/v1/completions"),
        _trace_ids(s.decoders[0], "/v1/completions"),
    )
    assert pre is not None and pre[0] == dec[0] == s.records()[0]["trace_id"]


def test_with_tracing_the_proxy_span_has_a_child_per_phase_in_the_clients_trace(setup):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    s = setup(provider=provider)
    tp = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"
    s.post("/v1/completions", completion(True, 3), headers={"traceparent": tp})
    spans = {sp.name: sp for sp in exporter.get_finished_spans()}
    root = spans["kvlens.pd.proxy"]
    assert format(root.context.trace_id, "032x") == CLIENT_TRACE
    assert format(root.parent.span_id, "016x") == "00f067aa0ba902b7"
    assert root.attributes["kvlens.pd.outcome"] == "ok"
    for phase in ("tokenize", "prefill", "transfer_wait", "decode"):
        child = spans[f"kvlens.pd.{phase}"]
        assert (
            child.parent.span_id == root.context.span_id and child.context.trace_id == root.context.trace_id
        )
    (pre,) = s.prefillers[0].requests("/v1/completions")
    (dec,) = s.decoders[0].requests("/v1/completions")
    assert pre.headers["traceparent"].split("-")[2] == format(
        spans["kvlens.pd.prefill"].context.span_id, "016x"
    )
    assert dec.headers["traceparent"].split("-")[2] == format(
        spans["kvlens.pd.decode"].context.span_id, "016x"
    )


def test_metrics_and_records_describe_each_request(setup):
    s = setup()
    s.post("/v1/completions", completion(True, 3))
    s.post("/v1/chat/completions", chat(False, 3))
    p, d = s.proxy.router.prefillers[0].name, s.proxy.router.decoders[0].name
    assert s.metric("kvlens_pd_proxy_requests_total", outcome="ok") == 2
    assert s.metric("kvlens_pd_proxy_in_flight") == 0
    for phase, n in (("prefill", 2), ("transfer_wait", 2), ("decode_first_token", 1), ("ttft", 1)):
        assert s.metric("kvlens_pd_proxy_phase_seconds_count", phase=phase, prefiller=p, decoder=d) == n
    records = s.records()
    assert [r["endpoint"] for r in records] == ["chat", "completions"]  # newest first
    for key in ("req_id", "prefiller", "decoder", "prompt_tokens", "outcome", "ttft_ms", "prefill_ms",
                "transfer_wait_ms", "decode_first_token_ms", "decoder_pd", "trace_id"):  # fmt: skip
        assert key in records[0]
    logged = [json.loads(line) for line in s.log.read_text().splitlines()]
    assert [r["req_id"] for r in logged] == [r["req_id"] for r in reversed(records)]


def test_late_and_foreign_notifications_are_counted_and_not_kept(setup):
    import zmq

    s = setup()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{s.zport}")
    from .pd_proxy_fakes import notice_bytes

    push.send(notice_bytes("not-ours"))
    push.send(b"\x93garbage")
    deadline = time.monotonic() + 10
    while s.metric("kvlens_pd_proxy_malformed_notifications_total") != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s.metric("kvlens_pd_proxy_stray_notifications_total") == 1
    assert s.metric("kvlens_pd_proxy_malformed_notifications_total") == 1
    assert s.proxy.board.waiting == 0
    push.close(linger=0)
    ctx.term()


def test_a_one_token_request_is_answered_by_the_prefiller_alone(setup):
    s = setup()
    answer = s.post("/v1/completions", completion(False, 1)).json()
    (pre,) = s.prefillers[0].requests("/v1/completions")  # a plain request: the fake answers " d0"
    assert answer["choices"][0]["text"] == " d0" and answer["id"].startswith("cmpl-dec")
    assert "kv_transfer_params" not in pre.body and pre.body["max_tokens"] == 1 and s.decoders[0].seen == []
    assert s.records()[0]["outcome"] == "prefill_only"


def test_bad_requests_are_refused_with_400_or_413(setup):
    s = setup(max_request_bytes=1000)
    assert s.post("/v1/completions", {"prompt": "x " * 1000, "max_tokens": 2}).status_code == 413
    assert s.http.post("/v1/completions", content=b"{not json").status_code == 400
    assert s.post("/v1/completions", {"max_tokens": 2}).status_code == 400
    assert s.post("/v1/completions", {"prompt": "hi", "max_tokens": 0}).status_code == 400
    assert s.post("/v1/completions", {"prompt": "hi", "n": 2}).status_code == 400
    assert s.prefillers[0].seen == []
    assert s.metric("kvlens_pd_proxy_requests_total", outcome="bad_request") == 5


def test_models_and_health(setup):
    s = setup()
    assert s.http.get("/v1/models").json()["data"][0]["id"] == "fake-model"
    assert s.http.get("/health").json()["status"] == "ok"


def test_no_pd_mode_relays_requests_round_robin(setup):
    s = setup(decoders=2, no_pd=True)
    for stream in (False, True, False, True):
        resp = s.post("/v1/completions", completion(stream, 3))
        assert resp.status_code == 200
    assert [len(e.requests("/v1/completions")) for e in s.decoders] == [2, 2]
    assert s.prefillers[0].seen == []
    assert all(r["outcome"] == "routed" for r in s.records())


def test_cli_refuses_ports_that_do_not_pair(capsys):
    code = cli_main(["pd-proxy", "--decoder-init-port", "1,2", "--decoder-alloc-port", "3"])
    assert code == 1 and "one port each per decoder TP rank" in capsys.readouterr().err


def test_a_client_that_leaves_during_the_wait_leaves_nothing_behind(setup):
    s = setup(prefill=Behaviour(notify="on_release"), notify_timeout_s=30)
    with s.http.stream("POST", "/v1/completions", json=completion(True, 3)) as resp:
        next(ln for ln in resp.iter_lines() if ln.startswith("data:"))
    deadline = time.monotonic() + 10
    while s.metric("kvlens_pd_proxy_in_flight") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s.metric("kvlens_pd_proxy_in_flight") == 0 and s.proxy.board.waiting == 0
    assert s.records()[0]["outcome"] == "client_gone" and s.decoders[0].seen == []


def test_a_first_token_that_ends_the_answer_needs_no_decoder(setup):
    s = setup(prefill=Behaviour(first_stop=True))
    events = sse_events(s.post("/v1/completions", completion(True, 5)).text)
    assert [e["choices"][0]["text"] for e in events[:-1]] == [" t777"]
    assert events[0]["choices"][0]["finish_reason"] == "stop" and events[-1] == "[DONE]"
    assert s.decoders[0].seen == [] and s.records()[0]["outcome"] == "prefill_only"


def test_the_command_serves_and_exports_spans_as_the_otel_variables_say(tmp_path):
    import os
    import subprocess
    import sys

    zport, port = free_port(), free_port()
    prefiller = FakeEngine("p", f"tcp://127.0.0.1:{zport}").start()
    decoder = FakeEngine("d").start()
    cmd = [sys.executable, "-m", "connector.ops.cli", "pd-proxy", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--prefiller-host", "127.0.0.1", "--prefiller-port", str(prefiller.port)]
    cmd += ["--decoder-host", "127.0.0.1", "--decoder-port", str(decoder.port)]
    cmd += ["--decoder-init-port", "7301", "--decoder-alloc-port", "7401"]
    cmd += ["--proxy-host", "127.0.0.1", "--proxy-port", str(zport)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env |= {"OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "pd-proxy-test"}
    out = tmp_path / "proxy.out"
    with open(out, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, trust_env=False)
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, out.read_text()[-3000:]
            try:
                if http.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.1)
        answer = http.post("/v1/completions", json=completion(False, 3)).json()
        assert answer["choices"][0]["text"] == " t777 d0 d1"
        http.close()
    finally:
        proc.terminate()
        proc.wait(30)
        prefiller.stop()
        decoder.stop()
    text = out.read_text()
    assert '"name": "kvlens.pd.proxy"' in text and '"name": "kvlens.pd.transfer_wait"' in text
    assert '"service.name": "pd-proxy-test"' in text


def test_a_silent_prefiller_is_a_504_after_the_backend_timeout(setup):
    s = setup(prefill=Behaviour(prefill_delay_s=30), backend_timeout_s=0.5)
    t0 = time.monotonic()
    resp = s.post("/v1/completions", completion(True))
    assert resp.status_code == 504 and time.monotonic() - t0 < 15
    assert "prefiller" in resp.json()["error"]["message"] and s.decoders[0].seen == []
    assert s.records()[0]["outcome"] == "prefill_failed" and s.proxy.board.waiting == 0
