"""PD across two addresses, as a network that is not trusted sees it: the decoder runs in a network
namespace of its own (a second "host", joined by a veth pair, reaching nothing else), both engines
share a PD key. The keyed pair serves plain vLLM's outputs with the decoder loading the whole
prompt; a sender without the key is refused and hands the decoder nothing; a request naming a
receiver the prefiller does not list sends nothing and is served."""

from __future__ import annotations

import pytest
import zmq

from connector.pd.identity import PeerIdentity
from connector.pd.receive_buffer import buffer_dir
from connector.pd.sender import PDSender
from tests.telemetry.serve import VllmServer, base_env, free_port, prompt_tokens, sum_samples, wait_until
from tests.unit.pd_wire_support import Done, records

from . import netns
from .conftest import CHUNK, DECODER_BUFFER, PDPair, pd_kv_config

pytestmark = pytest.mark.integration

MAX_TOKENS = 6
KEY = "the pair's PD key, shared by both hosts only"


@pytest.fixture(scope="module")
def two_hosts(tiny_model, tmp_path_factory, pd_pair):  # type: ignore[no-untyped-def]
    why = netns.available()
    if why is not None:
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("two-hosts")
    key_file = tmp / "pd.key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    ns = netns.create()
    context = zmq.Context()
    notices = context.socket(zmq.PULL)
    proxy_port = notices.bind_to_random_port("tcp://127.0.0.1")
    init_ports, alloc_ports = [free_port()], [free_port()]
    env = base_env(PYTHONHASHSEED="0")
    decoder_env = {**env, "KVLENS_ADMIN_TOKEN_DIR": str(tmp / "tokens")}
    prefiller = VllmServer(
        tiny_model,
        pd_kv_config(
            "sender",
            pd_proxy_host="127.0.0.1",
            pd_proxy_port=proxy_port,
            pd_buffer_size=64 << 20,
            pd_auth_key_file=str(key_file),
            pd_allowed_receivers=[ns.inner],
        ),
        tmp / "prefiller.log",
        env,
    )
    decoder = VllmServer(
        tiny_model,
        pd_kv_config(
            "receiver",
            pd_peer_host=ns.inner,
            pd_peer_init_port=init_ports,
            pd_peer_alloc_port=alloc_ports,
            pd_buffer_size=DECODER_BUFFER,
            pd_auth_key_file=str(key_file),
            extra_config={"admin_port": free_port()},
        ),
        tmp / "decoder.log",
        decoder_env,
        host=ns.inner,
        launcher=ns.exec,
    )
    try:
        for server in (prefiller, decoder):
            server.wait_ready()
        pair = PDPair(prefiller, decoder, pd_pair.plain, init_ports, alloc_ports, notices, None, proxy_port)
        yield pair, ns, tmp / "tokens"
    finally:
        for server in (prefiller, decoder):
            server.stop()
        notices.close(linger=0)
        context.term()
        ns.delete()


def _failed(server: VllmServer, side: str, reason: str) -> float:
    return sum_samples(server.samples(), "vllm:kvlens_pd_failed_transfers_total", side=side, reason=reason)


def test_a_keyed_pair_on_two_hosts_serves_plain_outputs_and_the_decoder_loads_the_prompt(two_hosts):
    pair, ns, _ = two_hosts
    prompt = prompt_tokens(CHUNK + 90, seed=3101)
    got = pair.run(prompt, MAX_TOKENS, host=ns.inner)
    assert got["tokens"] == pair.plain_tokens(prompt, MAX_TOKENS)
    received = got["decode"]["kv_transfer_params"]["kvlens"]["pd"]
    assert received["outcome"] == "loaded" and received["tokens"] == CHUNK + 90, received
    info = [s for s in pair.decoder.samples() if s[0] == "vllm:kvlens_info"]
    assert info and dict(info[0][1])["pd_auth"] == "key"


def test_a_sender_without_the_key_hands_the_other_host_nothing(two_hosts):
    pair, ns, _ = two_hosts
    before = _failed(pair.decoder, "receive", "auth_failed")
    # a peer that knows everything public: the model (so the key space), TP, layout, ports
    info = dict(next(labels for name, labels in pair.decoder.samples() if name == "vllm:kvlens_info"))
    forged = PeerIdentity(
        info["key_fingerprint"], 1, 0, int(info["block_size"]), CHUNK, info["record_layout"]
    )
    done = Done()
    tx = PDSender(forged, 2.0, 5.0)
    try:
        tx.send(_transfer(ns.inner, pair.init_ports[0], done))
        outcome = done.wait()
    finally:
        tx.close()
    assert not outcome.ok and outcome.reason == "auth_failed"
    pair.decoder.complete(prompt_tokens(8, seed=5), max_tokens=1)  # a step publishes the counters
    wait_until(
        lambda: _failed(pair.decoder, "receive", "auth_failed") == before + 1, what="the refusal counted"
    )


def _transfer(host: str, port: int, done: Done):  # type: ignore[no-untyped-def]
    from connector.pd.sender import Transfer

    chunk = records(1, 4096, 4096)[0]
    return Transfer("forged", "forged", host, port, 0, [("k" * 32, memoryview(chunk), CHUNK)], done)


def test_a_request_naming_a_receiver_the_prefiller_does_not_list_sends_nothing_and_is_served(two_hosts):
    pair, ns, _ = two_hosts
    reason = "spec_refused:receiver_not_allowed"
    before = _failed(pair.prefiller, "send", reason)
    prompt = prompt_tokens(CHUNK + 10, seed=3102)
    # this namespace's own end of the link: reachable, but not a receiver the operator listed
    got = pair.run(prompt, MAX_TOKENS, host=ns.outer)
    assert got["tokens"] == pair.plain_tokens(prompt, MAX_TOKENS)
    assert got["decode"]["kv_transfer_params"]["kvlens"]["pd"]["outcome"] == "none"
    wait_until(lambda: _failed(pair.prefiller, "send", reason) == before + 1, what="the refusal counted")


def test_stopping_the_decoder_leaves_neither_its_buffer_nor_its_token_file(two_hosts):
    """vLLM's stop SIGKILLs the engine core at once: the files it made for its lifetime still go."""
    pair, _, tokens = two_hosts
    buffers = set(buffer_dir().glob("kvlens-pd-*"))
    assert list(tokens.glob("admin-*.token"))  # the admin endpoint's, made at start
    pair.decoder.stop()  # SIGTERM to vllm serve, as an operator stops it
    wait_until(lambda: not list(tokens.glob("admin-*.token")), timeout=30, what="the token file removed")
    wait_until(
        lambda: len(buffers - set(buffer_dir().glob("kvlens-pd-*"))) == 1, timeout=30, what="buffer gone"
    )
