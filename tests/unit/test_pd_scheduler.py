"""The scheduler's pure PD pieces: a client's disagg_spec is bounded and checked, the decoder looks
up exactly the keys the prefiller sent, plans its asynchronous load at allocation, counts exactly
the tokens that loaded, and releases every claim once (loaded, failed, aborted, reported late)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from connector.config.pd import PDConfig
from connector.config.pd_trust import parse_list
from connector.engine.facts import EngineFacts
from connector.engine.keys import Namespace, PrefixHasher
from connector.engine.pd_jobs import PDLoadResult
from connector.scheduler.pd_decoder import PDDecoder, pd_lookup_keys
from connector.scheduler.pd_prefiller import PDPrefiller
from connector.scheduler.pd_spec import SpecRefused, read_pd_params, usable_req_id

CHUNK, BLOCK = 256, 128
ALLOWED = parse_list(("10.0.0.2",))  # the operator's pd_allowed_receivers
NS = Namespace("model", "bf16", "layout")


def spec(**over):
    base = {
        "req_id": "r-1",
        "receiver_host": "10.0.0.2",
        "receiver_init_port": [7300],
        "receiver_alloc_port": [7400],
    }
    return {"ret_first_tok": True, "disagg_spec": {**base, **over}}


def test_a_good_spec_is_read():
    params = read_pd_params(spec(), 1, ALLOWED)
    assert params.ret_first_tok and params.spec.req_id == "r-1" and params.spec.init_ports == (7300,)
    assert read_pd_params({"lmcache.skip_save": True}, 1, ALLOWED) is None
    assert read_pd_params({"ret_first_tok": True}, 1, ALLOWED).spec is None


@pytest.mark.parametrize(
    ("over", "reason"),
    [
        ({"req_id": ""}, "bad_req_id"),
        ({"req_id": "x" * 10_000}, "bad_req_id"),
        ({"req_id": "has space"}, "bad_req_id"),
        ({"req_id": 7}, "bad_req_id"),
        ({"receiver_host": "evil host;rm"}, "bad_host"),
        ({"receiver_host": "h" * 300}, "bad_host"),
        ({"receiver_host": None}, "bad_host"),
        ({"receiver_init_port": [0]}, "bad_ports"),
        ({"receiver_init_port": [70000]}, "bad_ports"),
        ({"receiver_init_port": [True]}, "bad_ports"),
        ({"receiver_init_port": "7300"}, "bad_ports"),
        ({"receiver_init_port": list(range(1, 5000))}, "bad_ports"),
        ({"receiver_alloc_port": [7400, 7401]}, "tp_mismatch"),
    ],
)
def test_a_lying_spec_is_refused_with_a_reason_never_a_crash(over, reason):
    with pytest.raises(SpecRefused) as e:
        read_pd_params(spec(**over), 1, ALLOWED)
    assert e.value.reason == reason


def test_a_refused_spec_keeps_a_usable_req_id_so_its_proxy_still_hears():
    assert usable_req_id(spec(receiver_host="bad host")) == "r-1"
    assert usable_req_id(spec(req_id="bad id")) is None
    assert usable_req_id({"disagg_spec": "nonsense"}) is None


@pytest.mark.parametrize("prefill_len", [CHUNK * 2, CHUNK * 2 + 77, CHUNK - 56, 1])
def test_the_decoder_looks_up_exactly_the_keys_the_prefiller_sends(prefill_len):
    prompt = list(range(10, 10 + prefill_len))
    decoder_prompt = prompt + [999]  # the proxy appends the first token
    sent = PrefixHasher(NS, CHUNK).keys(prompt, True, len(prompt))  # the prefiller's store candidates
    looked_up = pd_lookup_keys(PrefixHasher(NS, CHUNK), decoder_prompt, len(decoder_prompt))
    assert [k.hex for k in looked_up] == [k.hex for k in sent]
    assert looked_up[-1].end == prefill_len  # the last token is the decoder's to compute


@dataclass
class FakeReceiver:
    held: dict[str, int] = field(default_factory=dict)  # key -> tokens
    claims: dict[str, list[str]] = field(default_factory=dict)
    released: list[str] = field(default_factory=list)

    def present(self, keys):
        n = 0
        for k in keys:
            if k not in self.held:
                break
            n += 1
        return n

    def claim(self, keys, request_id):
        n = self.present(keys)
        if n == 0:
            return None
        self.claims[request_id] = list(keys[:n])
        loc = SimpleNamespace(buffer_name="buf", offset=0, length=100)
        return SimpleNamespace(
            keys=tuple(keys[:n]),
            locations=tuple((loc,) for _ in range(n)),
            bytes=100 * n,
            transfer_ms=1.5,
            received_at=0.0,
            req_id="r-1",
        )

    def release(self, request_id):
        assert request_id in self.claims, "released twice or never claimed"
        del self.claims[request_id]
        self.released.append(request_id)


def request(rid, prompt_len):
    tokens = list(range(5, 5 + prompt_len))
    return SimpleNamespace(request_id=rid, num_prompt_tokens=prompt_len, all_token_ids=tokens)


def decoder_with(prompt_len):
    req = request("d-1", prompt_len)
    sent = PrefixHasher(NS, CHUNK).keys(req.all_token_ids, True, prompt_len - 1)
    receiver = FakeReceiver({k.hex: k.num_tokens for k in sent})
    return PDDecoder(receiver, BLOCK, lambda: 1.0), receiver, req


def claims_agree(decoder, receiver):
    """The receive index's claims are the decoder's loads still out (every one holds a claim)."""
    return len(receiver.claims) == decoder.held


def test_the_load_is_planned_at_allocation_and_its_claim_released_once_on_the_report():
    decoder, receiver, req = decoder_with(CHUNK * 2 + 78)  # 2 chunks + a 77-token tail
    assert decoder.lookup(req, 0, PrefixHasher(NS, CHUNK)) == CHUNK * 2 + 77
    assert decoder.after_alloc(req, CHUNK * 2 + 77, list(range(100, 105)))
    (job,) = decoder.take_jobs()  # vLLM parks the request: the load goes out in this very step
    assert [c.block_ids for c in job.chunks] == [(100, 101), (102, 103), (104,)]
    assert [c.num_tokens for c in job.chunks] == [CHUNK, CHUNK, 77]
    assert job.chunks[0].where == (("buf", 0, 100),) and job.fail_blocks == ()
    assert decoder.take_jobs() == [] and receiver.claims and claims_agree(decoder, receiver)
    decoder.on_results({"d-1": PDLoadResult(True)})
    assert receiver.released == ["d-1"] and decoder.held == 0 and claims_agree(decoder, receiver)
    assert decoder.readmitted("d-1") and not decoder.readmitted("d-1")  # vLLM schedules it once more
    assert decoder.lookup(req, 0, PrefixHasher(NS, CHUNK)) == 0  # a request loads from the buffer once
    pd = decoder.finish("d-1")
    assert pd["outcome"] == "loaded" and pd["tokens"] == CHUNK * 2 + 77 and pd["bytes"] == 300
    assert receiver.released == ["d-1"]  # once


@pytest.mark.parametrize(
    ("failed", "loaded"), [({102, 103, 104}, CHUNK), ({100, 101, 102, 103, 104}, 0), ({104}, CHUNK * 2)]
)
def test_a_failed_load_counts_only_the_tokens_before_its_first_failed_block(failed, loaded):
    decoder, receiver, req = decoder_with(CHUNK * 2 + 78)
    decoder.lookup(req, 0, PrefixHasher(NS, CHUNK))
    decoder.after_alloc(req, CHUNK * 2 + 77, list(range(100, 105)))
    decoder.take_jobs()
    decoder.on_results({"d-1": PDLoadResult(False, "load_failed", failed)})
    assert receiver.released == ["d-1"] and claims_agree(decoder, receiver)
    (reported,) = decoder.take_reported()
    assert reported[1].outcome == "failed" and reported[1].tokens == loaded  # what vLLM keeps
    pd = decoder.finish("d-1")
    assert (pd["outcome"], pd["reason"], pd["tokens"]) == ("failed", "load_failed", loaded)


def test_vllms_own_hit_is_not_loaded_again():
    decoder, _, req = decoder_with(CHUNK * 2 + 1)
    assert decoder.lookup(req, BLOCK, PrefixHasher(NS, CHUNK)) == CHUNK * 2 - BLOCK
    assert decoder.after_alloc(req, CHUNK * 2 - BLOCK, [7, 8, 9, 10])
    (job,) = decoder.take_jobs()
    assert [(c.block_ids, c.first_block) for c in job.chunks] == [((8,), 1), ((9, 10), 0)]
    decoder.on_results({"d-1": PDLoadResult(False, "load_failed", {9, 10})})
    assert decoder.finish("d-1")["tokens"] == BLOCK  # block 8 loaded; vLLM had block 7


@pytest.mark.parametrize("late_steps", [0, 1, 3])
def test_an_abort_while_the_load_is_out_releases_its_claim_once_when_the_report_comes(late_steps):
    decoder, receiver, req = decoder_with(CHUNK + 1)
    decoder.lookup(req, 0, PrefixHasher(NS, CHUNK))
    decoder.after_alloc(req, CHUNK, [1, 2])
    decoder.take_jobs()
    assert decoder.finish("d-1")["outcome"] == "none"  # aborted: the workers may be reading the slots
    for _ in range(late_steps):  # vLLM's asynchronous scheduling: steps go on before the report
        assert decoder.take_jobs() == [] and receiver.released == [] and claims_agree(decoder, receiver)
        decoder.step()
    decoder.on_results({"d-1": PDLoadResult(False, "load_failed", {2})})
    decoder.on_results({"d-1": PDLoadResult(False, "load_failed", {2})})  # a stray duplicate
    assert receiver.released == ["d-1"] and decoder.held == 0 and claims_agree(decoder, receiver)
    assert [rid for rid, _ in decoder.take_reported()] == ["d-1"]  # counted once, in pd_loads
    assert not decoder.readmitted("d-1")  # it never comes back
    assert decoder.finish("d-1")["outcome"] == "none"  # nothing kept for it


def test_an_abort_before_allocation_claims_nothing():
    decoder, receiver, req = decoder_with(CHUNK + 1)
    assert decoder.lookup(req, 0, PrefixHasher(NS, CHUNK)) == CHUNK
    assert decoder.finish("d-1")["outcome"] == "none"
    assert not decoder.after_alloc(req, CHUNK, [1, 2])  # a stale lookup is never claimed
    assert receiver.claims == {} and receiver.released == [] and decoder.take_jobs() == []


def test_records_gone_at_allocation_still_end_the_load_with_every_block_failed():
    decoder, receiver, req = decoder_with(CHUNK + 1)
    decoder.lookup(req, 0, PrefixHasher(NS, CHUNK))
    receiver.held.clear()  # expired between lookup and allocation
    assert decoder.after_alloc(req, CHUNK, [4, 5])  # vLLM waits for the report: a job must go out
    (job,) = decoder.take_jobs()
    assert job.chunks == () and job.fail_blocks == (4, 5) and job.fail_reason == "claim_lost"
    decoder.on_results({"d-1": PDLoadResult(False, "claim_lost", {4, 5})})
    assert receiver.released == []  # nothing was claimed
    assert decoder.finish("d-1")["reason"] == "claim_lost"


def test_a_claim_short_of_the_lookup_loads_what_it_holds_and_fails_the_rest():
    decoder, receiver, req = decoder_with(CHUNK * 2 + 78)
    keys = pd_lookup_keys(PrefixHasher(NS, CHUNK), req.all_token_ids, req.num_prompt_tokens)
    decoder.lookup(req, 0, PrefixHasher(NS, CHUNK))
    del receiver.held[keys[1].hex]  # the second chunk expired meanwhile
    assert decoder.after_alloc(req, CHUNK * 2 + 77, list(range(100, 105)))
    (job,) = decoder.take_jobs()
    assert [c.block_ids for c in job.chunks] == [(100, 101)]
    assert job.fail_blocks == (102, 103, 104) and job.fail_reason == "claim_lost"


def test_two_requests_on_the_same_records_each_release_their_own_claim():
    decoder, receiver, req = decoder_with(CHUNK + 1)
    twin = request("d-2", CHUNK + 1)
    for r, blocks in ((req, [1, 2]), (twin, [3, 4])):
        decoder.lookup(r, 0, PrefixHasher(NS, CHUNK))
        assert decoder.after_alloc(r, CHUNK, blocks)
    assert [j.request_id for j in decoder.take_jobs()] == ["d-1", "d-2"]
    assert claims_agree(decoder, receiver) and decoder.held == 2
    decoder.on_results({"d-2": PDLoadResult(True)})
    assert receiver.released == ["d-2"] and claims_agree(decoder, receiver)
    decoder.finish("d-1")
    decoder.on_results({"d-1": PDLoadResult(True)})
    assert receiver.released == ["d-2", "d-1"] and claims_agree(decoder, receiver)


def test_no_record_no_hit_and_outcome_none():
    decoder, _, req = decoder_with(CHUNK + 1)
    other = request("d-2", CHUNK + 1)
    other.all_token_ids = [1] * (CHUNK + 1)
    assert decoder.lookup(other, 0, PrefixHasher(NS, CHUNK)) == 0
    assert decoder.finish("d-2")["outcome"] == "none"


FACTS = EngineFacts("model", "bf16", BLOCK, 4, 1000, "layout", 1, "kv_producer")


def test_the_prefiller_plans_one_send_of_every_prompt_chunk_when_the_prompt_is_complete():
    pd = PDConfig(
        enabled=True,
        role="sender",
        buffer_size=1 << 20,
        proxy_host="h",
        proxy_port=1,
        allowed_receivers=("10.0.0.2",),
    )
    prefiller = PDPrefiller(pd, FACTS, "space")
    req = request("p-1", CHUNK + 10)
    req.kv_transfer_params = spec()
    req.output_token_ids = [42]
    prefiller.note(req)
    hasher = PrefixHasher(NS, CHUNK)
    tracker = SimpleNamespace(
        prefill_done=False,
        hasher=hasher,
        prompt_len=CHUNK + 10,
        blocks_of=lambda k, bs: tuple(range(k.start // bs, -(-k.end // bs))),
    )
    assert prefiller.plan({"p-1": tracker}, {"p-1": req}) == []  # not computed yet
    tracker.prefill_done = True
    (job,) = prefiller.plan({"p-1": tracker}, {"p-1": req})
    assert [c.num_tokens for c in job.chunks] == [CHUNK, 10] and job.notify and job.refused is None
    assert prefiller.plan({"p-1": tracker}, {"p-1": req}) == []  # once
    out = prefiller.finish(req)
    assert out["first_tok"] == 42 and out["pd"] == {
        "role": "sender",
        "tokens": CHUNK + 10,
        "bytes": out["pd"]["bytes"],
        "destinations": 1,
    }


def test_a_refused_spec_sends_nothing_but_its_proxy_is_still_notified():
    pd = PDConfig(enabled=True, role="sender", buffer_size=1 << 20, proxy_host="h", proxy_port=1)
    prefiller = PDPrefiller(pd, FACTS, "space")
    req = request("p-2", 20)
    req.kv_transfer_params = spec(receiver_init_port=[1, 2])
    prefiller.note(req)
    tracker = SimpleNamespace(prefill_done=True)
    (job,) = prefiller.plan({"p-2": tracker}, {"p-2": req})
    assert job.refused == "tp_mismatch" and job.chunks == () and job.notify and job.req_id == "r-1"
    assert prefiller.take_refusals() == {"tp_mismatch": 1}
