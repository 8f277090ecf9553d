"""A PD load that fails on the decoder never leaves stale KV where vLLM may share it (issue 36
item 8), on the shared real pair.

A hostile peer sends the decoder, under the first key its lookup computes for a prompt, a record
whose length is not whole blocks (the wire accepts it: a peer chooses its lengths; the worker's
copy refuses it), so the decoder's load of that prompt fails at its first block. The keys come
from the real prefiller: it is sent the prompt with a spy on loopback as its decoder, which answers
the handshake as the decoder would, reads the transfer's ALLOC (keys and record lengths) and
refuses it. The hostile record goes out through ``PDSender`` with the decoder's own identity (read
by ``probe_receiver``), so the wire's handshake reaches the test through the code that owns it.

The decoder's prompt is longer than one step's token budget (2,048), so a load in the step
computes the next 2,048 tokens over the failed chunk. With a load in the step (before this
change), vLLM cached those blocks when it allocated them; on a synchronous engine (vLLM's CPU
backend) its failed-load handling protects the requests of that step and the owner recomputes
every block before anyone else reads it, unless the owner leaves first: a client that hangs up
while the failing step runs has its request freed before the failure is handled (vLLM handles
aborts before a step's output), its blocks stay cached, unfilled or computed over unfilled ones,
and the next request sharing the prefix is served from them. The test hangs up when the decoder
logs the failed load (with a load in the step, before that step's forward pass ends). On GPUs
(asynchronous scheduling) no abort is needed: a request planned before the failure is reported
reads the blocks. Loaded asynchronously, the blocks are cached only once the load is reported
and only those that loaded.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from pathlib import Path

import pytest

from connector.pd import wire
from connector.pd.identity import PeerIdentity
from connector.pd.probe import probe_receiver
from connector.pd.sender import PDSender, Transfer
from tests.telemetry.serve import prompt_tokens, sum_samples, wait_until
from tests.unit.pd_wire_support import answer_handshake

from .conftest import CHUNK

pytestmark = pytest.mark.integration

HOST = "127.0.0.1"
WAIT_S = 60.0
MAX_TOKENS = 8
STEP_BUDGET = 2048  # vLLM's max_num_batched_tokens for `vllm serve` on CPU (one rank)
SHARED = CHUNK + STEP_BUDGET  # what the failing step computes: the failed chunk, then a full step
FAILED_LOAD = "from the receive buffer failed"  # the decoder's log line for a failed PD load
IDLE = {"entries": 0, "used": 0, "receiving": 0, "sending": 0}


def decoder_identity(pair) -> PeerIdentity:
    """The decoder's identity, as its alloc port tells any prober (a refused probe says it too)."""
    probe = probe_receiver(HOST, pair.alloc_ports[0], PeerIdentity("probe", 1, 0, 1, 1, "probe"), 10.0)
    assert probe.identity is not None, probe
    return probe.identity


class KeySpy:
    """A decoder stand-in for one transfer: it answers the prefiller's handshake as ``ident``,
    reads the ALLOC (the keys and record lengths the decoder would be sent) and refuses it."""

    def __init__(self, ident: PeerIdentity) -> None:
        self._listener = socket.create_server((HOST, 0))
        self.port = self._listener.getsockname()[1]
        self._ident = ident
        self.alloc: dict | None = None
        self._done = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        try:
            self._listener.settimeout(WAIT_S)
            conn, _ = self._listener.accept()
            with conn:
                conn.settimeout(WAIT_S)
                answer_handshake(conn, self._ident)
                kind, body = wire.recv_frame(conn, wire.Deadline(WAIT_S), WAIT_S)
                if kind is wire.FrameType.ALLOC:
                    self.alloc = wire.decode_control(body)
                refused = {"ok": False, "reason": "buffer_full"}
                conn.sendall(wire.control_frame(wire.FrameType.REPLY, refused))
        finally:
            self._listener.close()
            self._done.set()

    def wait(self) -> dict:
        assert self._done.wait(WAIT_S) and self.alloc is not None, "the prefiller sent the spy no ALLOC"
        return self.alloc


def keys_of(pair, prompt: list[int], ident: PeerIdentity) -> tuple[int, dict]:
    """The prefiller's first token for ``prompt`` and the ALLOC it sent the spy."""
    spy = KeySpy(ident)
    req_id = f"spy-{spy.port}"
    spec = pair.spec(req_id, init=[spy.port], alloc=[spy.port])
    answer = pair.prefiller.complete(
        prompt, max_tokens=1, kv_transfer_params={"ret_first_tok": True, "disagg_spec": spec}
    )
    alloc = spy.wait()
    pair.wait_notice(req_id)  # the refused transfer ended on the prefiller
    return answer["kv_transfer_params"]["first_tok"], alloc


def plant_broken_record(pair, ident: PeerIdentity, key: str, length: int) -> None:
    """A hostile peer sends the decoder ``key`` with a record 4 KiB shorter than ``length`` (the
    right one): not whole blocks of this layout."""
    bad = length - 4096
    done: list = []
    sender = PDSender(ident, 5.0, 10.0)
    try:
        record = memoryview(bytes(bad))
        sender.send(
            Transfer(
                "hostile",
                "hostile",
                HOST,
                pair.init_ports[0],
                pair.alloc_ports[0],
                [(key, record, CHUNK)],
                done.append,
            )
        )
        wait_until(lambda: done, timeout=WAIT_S, what="the hostile transfer's end")
    finally:
        sender.close()
    assert done[0].ok, f"the decoder refused the broken record ({done[0].reason}): the test needs it"


class LogWatch:
    """New lines of a server's log from now on."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._offset = path.stat().st_size

    def wait_for(self, text: str, timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(self._path, "rb") as f:
                f.seek(self._offset)
                if text.encode() in f.read():
                    return
            time.sleep(0.002)
        raise TimeoutError(f"{text!r} not logged within {timeout}s")


def stream(server, prompt: list[int], max_tokens: int) -> http.client.HTTPConnection:
    """A streaming completion whose answer nobody reads; closing it aborts the request."""
    conn = http.client.HTTPConnection(HOST, server.port, timeout=WAIT_S)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn


def tokens(server, prompt: list[int]) -> list[int]:
    answer = server.complete(prompt, max_tokens=MAX_TOKENS, return_token_ids=True)
    return answer["choices"][0]["token_ids"]


def failed_loads(pair) -> float:
    return sum_samples(pair.decoder.samples(), "vllm:kvlens_pd_loads_total", outcome="failed")


def broken_prompt(pair, seed: int) -> tuple[list[int], list[int]]:
    """(the decoder's prompt, a prompt sharing its first SHARED tokens): the decoder holds a
    broken record under the first key its lookup computes for the first."""
    ident = decoder_identity(pair)
    prompt = prompt_tokens(SHARED + 200, seed=seed)
    first_tok, alloc = keys_of(pair, prompt, ident)
    assert alloc["tokens"][0] == CHUNK and len(alloc["keys"]) == len(prompt) // CHUNK + 1
    plant_broken_record(pair, ident, alloc["keys"][0], alloc["lengths"][0])
    other = prompt[:SHARED] + prompt_tokens(64, seed=seed + 1)
    return prompt + [first_tok], other


def test_a_failed_load_is_recomputed_and_no_request_sharing_its_prefix_is_served_its_blocks(pd_pair):
    # Served: the first request's load fails and it is recomputed; a request sharing its prefix,
    # sent while it is served, is served right too.
    decoder_prompt, other = broken_prompt(pd_pair, seed=401)
    before = failed_loads(pd_pair)
    watch = LogWatch(pd_pair.decoder.log_path)
    first: dict = {}

    def serve_first() -> None:
        first.update(pd_pair.decoder.complete(decoder_prompt, MAX_TOKENS, return_token_ids=True))

    served = threading.Thread(target=serve_first)
    served.start()
    watch.wait_for(FAILED_LOAD)  # the first request's load failed: it is being recomputed
    second = tokens(pd_pair.decoder, other)
    served.join(WAIT_S)
    assert first["choices"][0]["token_ids"] == pd_pair.plain_tokens(decoder_prompt, MAX_TOKENS)
    assert second == tokens(pd_pair.plain, other)
    pd = first["kv_transfer_params"]["kvlens"]["pd"]
    assert (pd["outcome"], pd["reason"], pd["tokens"]) == ("failed", "load_failed", 0), pd
    wait_until(lambda: failed_loads(pd_pair) > before, what="the failed load counted")
    assert pd_pair.idle() == IDLE

    # Aborted: the client hangs up while the failing step runs; the next request sharing the
    # prefix is served right, not from blocks the first one left.
    decoder_prompt, other = broken_prompt(pd_pair, seed=409)
    watch = LogWatch(pd_pair.decoder.log_path)
    conn = stream(pd_pair.decoder, decoder_prompt, 200)
    try:
        watch.wait_for(FAILED_LOAD)
    finally:
        conn.sock.close()
        conn.close()
    assert pd_pair.idle() == IDLE  # the load was reported: its claim released once, nothing held
    assert tokens(pd_pair.decoder, other) == tokens(pd_pair.plain, other)
