"""PD failures with real engines (issue 28 item 5): each ends in a bounded, counted outcome, the
request is still served with the plain instance's output, the proxy is notified, nothing leaks."""

from __future__ import annotations

import http.client
import json
import time

import pytest

from connector.pd.identity import PeerIdentity
from connector.pd.sender import PDSender, Transfer
from tests.telemetry.serve import free_port, prompt_tokens, sum_samples, wait_until

from .conftest import CHUNK, DECODER_BUFFER, TOKEN_BYTES, UNCLAIMED_S

pytestmark = pytest.mark.integration

MAX_TOKENS = 6
IDLE = {"entries": 0, "used": 0, "receiving": 0, "sending": 0}


def failed(server, side: str, reason: str) -> float:
    return sum_samples(server.samples(), "vllm:kvlens_pd_failed_transfers_total", side=side, reason=reason)


def test_decoder_down_the_prefill_still_answers_and_notifies_and_the_decoder_recomputes(pd_pair):
    prompt = prompt_tokens(CHUNK + 40, seed=101)
    before = failed(pd_pair.prefiller, "send", "unreachable")
    nobody = [free_port()]
    got = pd_pair.run(prompt, MAX_TOKENS, init=nobody, alloc=nobody)  # the notice came, or run() raised
    assert got["tokens"] == pd_pair.plain_tokens(prompt, MAX_TOKENS)
    assert got["decode"]["kv_transfer_params"]["kvlens"]["pd"]["outcome"] == "none"
    wait_until(lambda: failed(pd_pair.prefiller, "send", "unreachable") > before, what="unreachable counted")
    assert pd_pair.idle() == IDLE


def test_a_prompt_larger_than_the_decoder_buffer_is_refused_counted_and_recomputed(pd_pair):
    length = DECODER_BUFFER // TOKEN_BYTES + CHUNK  # one chunk more than the buffer holds
    prompt = prompt_tokens(length, seed=103)
    before = failed(pd_pair.decoder, "receive", "too_large")
    got = pd_pair.run(prompt, MAX_TOKENS)
    assert got["tokens"] == pd_pair.plain_tokens(prompt, MAX_TOKENS)
    assert got["decode"]["kv_transfer_params"]["kvlens"]["pd"]["outcome"] == "none"
    assert failed(pd_pair.decoder, "receive", "too_large") == before + 1
    assert failed(pd_pair.prefiller, "send", "too_large") >= 1
    assert pd_pair.idle() == IDLE


def test_a_spec_for_another_tp_size_is_refused_and_the_proxy_still_hears(pd_pair):
    prompt = prompt_tokens(CHUNK + 5, seed=107)
    two = [free_port(), free_port()]  # a decoder with TP 2 for this TP-1 prefiller
    got = pd_pair.run(prompt, MAX_TOKENS, init=two, alloc=two)
    assert got["tokens"] == pd_pair.plain_tokens(prompt, MAX_TOKENS)
    wait_until(
        lambda: failed(pd_pair.prefiller, "send", "spec_refused:tp_mismatch") >= 1, what="tp_mismatch counted"
    )
    assert pd_pair.idle() == IDLE


def test_a_peer_with_another_identity_is_refused_at_the_handshake_naming_what_differs(pd_pair):
    """A prefiller whose chunk size and key space differ (here a bare sender in the test process)."""
    outcomes = []
    sender = PDSender(PeerIdentity("another-model", 1, 0, 128, 512, "x"), 5.0, 5.0)
    try:
        record = memoryview(bytearray(CHUNK * TOKEN_BYTES))
        sender.send(
            Transfer(
                "rogue",
                "rogue",
                "127.0.0.1",
                pd_pair.init_ports[0],
                pd_pair.alloc_ports[0],
                [("00" * 32, record, CHUNK)],
                outcomes.append,
            )
        )
        wait_until(lambda: outcomes, timeout=20, what="the sender's outcome")
    finally:
        sender.close()
    assert not outcomes[0].ok and outcomes[0].reason.startswith("mismatch:")
    assert "key_space" in outcomes[0].reason and "chunk_size" in outcomes[0].reason
    prompt = prompt_tokens(CHUNK * 2, seed=109)  # and the pair still serves
    got = pd_pair.run(prompt, MAX_TOKENS)
    assert got["tokens"] == pd_pair.plain_tokens(prompt, MAX_TOKENS)
    assert got["decode"]["kv_transfer_params"]["kvlens"]["pd"]["outcome"] == "loaded"
    # counted by the decoder (an idle engine reports nothing: its metrics move with its next step)
    wait_until(lambda: failed(pd_pair.decoder, "receive", "mismatch") >= 1, what="mismatch counted")
    assert pd_pair.idle() == IDLE


def _abort_after_sending(server, body: dict) -> None:
    """Send a streaming completion and hang up before reading the answer (a client abort)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    time.sleep(0.05)
    conn.sock.close()
    conn.close()


def test_a_client_abort_on_the_decoder_frees_its_records(pd_pair):
    prompt = prompt_tokens(CHUNK * 3, seed=113)
    req_id = "abort-1"
    pd_pair.prefiller.complete(
        prompt, max_tokens=1, kv_transfer_params={"ret_first_tok": True, "disagg_spec": pd_pair.spec(req_id)}
    )
    pd_pair.wait_notice(req_id)
    body = {"model": "tiny", "prompt": prompt + [5], "max_tokens": 200, "ignore_eos": True, "stream": True}
    _abort_after_sending(pd_pair.decoder, body)
    assert pd_pair.idle() == IDLE  # loaded or released at the abort: nothing held
    again = prompt_tokens(CHUNK + 9, seed=127)
    assert pd_pair.run(again, MAX_TOKENS)["tokens"] == pd_pair.plain_tokens(again, MAX_TOKENS)


def test_records_nobody_claims_expire_and_are_counted(pd_pair):
    prompt = prompt_tokens(CHUNK * 2 + 3, seed=131)
    req_id = "never-decoded"
    pd_pair.prefiller.complete(
        prompt, max_tokens=1, kv_transfer_params={"ret_first_tok": True, "disagg_spec": pd_pair.spec(req_id)}
    )
    pd_pair.wait_notice(req_id)
    before = sum_samples(pd_pair.decoder.samples(), "vllm:kvlens_pd_loads_total", outcome="expired")
    time.sleep(UNCLAIMED_S + 2)  # the decode never comes; the idle decoder expires on its own
    other = prompt_tokens(CHUNK + 1, seed=137)  # a request makes the decoder step and report
    assert pd_pair.run(other, MAX_TOKENS)["tokens"] == pd_pair.plain_tokens(other, MAX_TOKENS)
    expired = sum_samples(pd_pair.decoder.samples(), "vllm:kvlens_pd_loads_total", outcome="expired")
    assert expired - before == 3  # two chunks and the tail, freed without a load
    assert pd_pair.idle() == IDLE
