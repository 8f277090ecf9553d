"""The pure parts of ``kvlens pd-proxy``: LMCache's host/port pairing, the ProxyNotif wire format,
server-sent events cut anywhere, the request bodies sent to each side, the client's usage."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from connector.pd_proxy import answers
from connector.pd_proxy import requests as reqs
from connector.pd_proxy.backends import Backend, ProxySettings, RoundRobin, pair_hosts_and_ports
from connector.pd_proxy.notices import NoticeBoard, decode_notice, encode_notice
from connector.pd_proxy.observe import new_traceparent, parse_traceparent, tracing_configured


def test_hosts_and_ports_pair_as_in_lmcaches_proxy():
    assert pair_hosts_and_ports(["h"], [8100], 3) == [("h", 8100), ("h", 8101), ("h", 8102)]
    assert pair_hosts_and_ports(["h"], [1, 5], 1) == [("h", 1), ("h", 5)]
    assert pair_hosts_and_ports(["a", "b"], [7], 1) == [("a", 7), ("b", 7)]
    assert pair_hosts_and_ports(["a", "b"], [1, 2], 1) == [("a", 1), ("b", 2)]
    with pytest.raises(ValueError):
        pair_hosts_and_ports(["a", "b", "c"], [1, 2], 1)


def test_decoders_on_counted_ports_get_counted_receiver_ports_too():
    s = ProxySettings(
        decoder_port=[8200], num_decoders=2, decoder_init_port=[8300, 8301], decoder_alloc_port=[8400, 8401]
    )
    assert [(d.port, d.init_ports, d.alloc_ports) for d in s.decoders()] == [
        (8200, (8300, 8301), (8400, 8401)),
        (8201, (8301, 8302), (8401, 8402)),
    ]
    listed = ProxySettings(
        decoder_host=["a", "b"], decoder_port=[8200], decoder_init_port=[9], decoder_alloc_port=[10]
    )
    assert [d.init_ports for d in listed.decoders()] == [(9,), (9,)]  # other hosts: the same ports


def test_round_robin_pairs_the_nth_prefiller_and_decoder():
    rr = RoundRobin([Backend("p", 1), Backend("p", 2)], [Backend("d", 1), Backend("d", 2), Backend("d", 3)])
    picks = [(p.port, d.port) for p, d in (rr.pick() for _ in range(6))]
    assert picks == [(1, 1), (2, 2), (1, 3), (2, 1), (1, 2), (2, 3)]


def test_proxynotif_is_lmcaches_tagged_struct():
    wire = msgspec.msgpack.encode({"type": "ProxyNotif", "req_id": "r1"})
    assert decode_notice(wire) == "r1" and encode_notice("r1") == wire
    assert decode_notice(msgspec.msgpack.encode({"type": "AllocResponse", "req_id": "r1"})) is None
    assert decode_notice(b"\xc1") is None


def test_the_board_keeps_only_waiting_requests():
    async def scenario():
        board = NoticeBoard()
        board.notice("early")  # nobody waits: counted, not kept
        board.expect("r", 2)
        board.notice("r")
        late = await board.wait("r", 0.01)
        board.notice("r")
        done = await board.wait("r", 5)
        board.forget("r")
        board.notice("r")
        return board, late, done

    board, late, done = asyncio.run(scenario())
    assert (late.arrived, late.complete) == (1, False) and done.complete
    assert board.stray == 2 and board.waiting == 0


def test_events_are_split_wherever_the_bytes_are_cut():
    stream = answers.sse({"a": 1}) + b"data: [DONE]\n\n"
    for cut in range(1, len(stream)):
        splitter = answers.EventSplitter()
        got = list(splitter.feed(stream[:cut])) + list(splitter.feed(stream[cut:]))
        assert got == ['{"a":1}', "[DONE]"], cut


def test_prefill_and_decode_bodies_follow_lmcaches_protocol():
    data = {
        "model": "m",
        "prompt": "x",
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    data |= {"temperature": 0.5, "kv_transfer_params": {"client": 1}, "min_tokens": 3}
    decoder = Backend("d", 1, (11, 12), (21, 22))
    pre = reqs.prefill_body("completions", data, [1, 2], "rid", decoder)
    assert (
        pre["prompt"] == [1, 2]
        and pre["max_tokens"] == 1
        and pre["stream"] is False
        and pre["min_tokens"] == 1
    )
    assert "stream_options" not in pre and pre["temperature"] == 0.5
    assert pre["kv_transfer_params"] == {
        "ret_first_tok": True,
        "disagg_spec": {
            "req_id": "rid",
            "receiver_host": "d",
            "receiver_init_port": [11, 12],
            "receiver_alloc_port": [21, 22],
        },
    }
    dec = reqs.decode_body("completions", data, [1, 2], 9, 5, True)
    assert dec["prompt"] == [1, 2, 9] and dec["max_tokens"] == 4 and dec["min_tokens"] == 2
    assert "kv_transfer_params" not in dec and dec["stream_options"] == {"include_usage": True}


def test_chat_requests_keep_only_what_a_completion_understands():
    data = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3}
    data |= {"tools": [], "logprobs": True, "top_p": 0.9}
    assert reqs.check("chat", data) == 3
    body = reqs.prefill_body("chat", data, [1], "rid", None)
    assert body == {"model": "m", "top_p": 0.9, "prompt": [1], "max_tokens": 1, "stream": False}
    assert reqs.tokenize_body("chat", data) == {"messages": data["messages"], "tools": [], "model": "m"}


@pytest.mark.parametrize(
    "data",
    [
        {},
        {"prompt": ""},
        {"prompt": [1, "a"]},
        {"prompt": "x", "max_tokens": 0},
        {"prompt": "x", "max_tokens": 1.5},
    ],
)
def test_requests_the_proxy_cannot_serve_are_refused(data):
    with pytest.raises(reqs.BadRequest):
        reqs.check("completions", data)


def test_usage_counts_the_first_token_as_generated():
    assert answers.client_usage({"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15}) == {
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "total_tokens": 15,
    }


def test_traceparents():
    tp = new_traceparent("ab" * 16, "00")
    assert parse_traceparent(tp) == ("ab" * 16, "00")
    assert parse_traceparent("00-" + "0" * 32 + "-" + "1" * 16 + "-01") is None
    assert parse_traceparent("garbage") is None
    assert not tracing_configured({})
    assert tracing_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"})
    assert not tracing_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c", "OTEL_SDK_DISABLED": "true"})


def test_a_stream_whose_client_left_before_it_began_is_still_finished():
    from starlette.requests import ClientDisconnect

    from connector.pd_proxy.server import FinishedStream

    ended = []

    async def body():
        try:
            yield b"data: x\n\n"
        finally:
            ended.append("body")

    async def on_close():
        ended.append("request finished")

    async def send(message):
        raise OSError("the client is gone")

    async def receive():
        return {"type": "http.disconnect"}

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", "path": "/", "headers": []}
    with pytest.raises((OSError, ClientDisconnect)):  # Starlette says ClientDisconnect
        asyncio.run(FinishedStream(body(), on_close)(scope, receive, send))
    assert ended == ["request finished"]  # the body never began, the request still ended
