"""1P1D with real engines: greedy outputs equal one plain vLLM's, the decoder computes no token
it was sent, and the buffer's leak gauges return to 0."""

from __future__ import annotations

import pytest

from tests.telemetry.serve import prompt_tokens, sum_samples, traceparent, wait_until

from .conftest import CHUNK

pytestmark = pytest.mark.integration

MAX_TOKENS = 8


def p2p_cached(server) -> float:
    return sum_samples(server.samples(), "vllm:prompt_tokens_cached_by_source_total", source="p2p")


@pytest.mark.parametrize(
    "length",
    [CHUNK * 2, CHUNK * 2 + 77, CHUNK - 56],
    ids=["chunk_multiple", "with_tail", "shorter_than_a_chunk"],
)
def test_1p1d_outputs_equal_one_plain_instance_and_the_decoder_computes_no_sent_token(
    pd_pair, length, capsys
):
    prompt = prompt_tokens(length, seed=length)
    before = p2p_cached(pd_pair.decoder)
    got = pd_pair.run(prompt, MAX_TOKENS)
    assert got["tokens"] == pd_pair.plain_tokens(prompt, MAX_TOKENS)
    sent = got["prefill"]["kv_transfer_params"]["kvlens"]["pd"]
    assert sent == {"role": "sender", "tokens": length, "bytes": sent["bytes"], "destinations": 1}
    received = got["decode"]["kv_transfer_params"]["kvlens"]["pd"]
    assert received["role"] == "receiver" and received["outcome"] == "loaded", received
    assert received["tokens"] == length  # every prompt token the prefiller computed
    assert received["bytes"] == sent["bytes"] and received["transfer_ms"] > 0
    # what it received is what KVLens supplied: LMCache's field and the breakdown say so, no miss
    params = got["decode"]["kv_transfer_params"]
    assert params["num_lmcache_cached_tokens"] == length
    usage = params["kvlens"]
    assert usage["hit_tokens"] == length and usage["loaded_tokens"] == {"pd": length}
    assert usage["miss_reason"] is None, usage
    with capsys.disabled():
        print(f"\nPD {length} tokens: {received}, proxy waited {got['waited_s'] * 1000:.1f} ms")
    # vLLM's own count: every sent token was a P2P hit on the decoder, computed by nobody there
    wait_until(lambda: p2p_cached(pd_pair.decoder) - before == length, what="p2p cached tokens")
    assert pd_pair.idle() == {"entries": 0, "used": 0, "receiving": 0, "sending": 0}


def test_one_trace_holds_the_send_and_the_receive(pd_pair):
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    prompt = prompt_tokens(CHUNK + 30, seed=211)
    got = pd_pair.run(prompt, 3, traceparent=traceparent(trace_id))
    spans = pd_pair.spans.wait_for(
        lambda s: {"kvlens.pd.send", "kvlens.pd.receive"} <= {x.name for x in s if x.trace_id == trace_id},
        timeout=60,
    )
    by_name = {s.name: s for s in spans if s.trace_id == trace_id}
    send, receive = by_name["kvlens.pd.send"], by_name["kvlens.pd.receive"]
    assert (
        send.attributes["kvlens.pd.req_id"] == got["req_id"] and send.attributes["kvlens.pd.outcome"] == "ok"
    )
    assert send.attributes["kvlens.pd.tokens"] == CHUNK + 30 and send.attributes["kvlens.pd.bytes"] > 0
    assert receive.attributes["kvlens.pd.outcome"] == "loaded"
    assert receive.attributes["kvlens.pd.bytes"] == send.attributes["kvlens.pd.bytes"]
    assert receive.attributes["kvlens.pd.notify_wait_ms"] >= 0
