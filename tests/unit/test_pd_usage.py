"""A decoder's response and request log count the tokens a prefiller sent as KVLens's: in
num_lmcache_cached_tokens and the kvlens breakdown (a "pd" source), never as a miss; a failed
PD load counts nothing."""

from __future__ import annotations

from connector.engine.outcomes import MissReason, RequestSummary
from connector.scheduler.pd_usage import received_tokens, summary_with_received, with_received

# what a decoder without tiers answers today for a prompt it got whole from a prefiller
TIERS_SAY = {
    "num_lmcache_cached_tokens": 0,
    "kvlens": {
        "vllm_cached_tokens": 0,
        "hit_tokens": 0,
        "loaded_tokens": {},
        "load_ms": 0.0,
        "failed_blocks": 0,
        "recomputed_tokens": 0,
        "miss_reason": "not_stored",
        "save_skip_reason": "kv_consumer",
    },
}
LOADED = {"role": "receiver", "outcome": "loaded", "reason": None, "tokens": 867, "bytes": 1}


def test_received_tokens_count_as_kvlenss_and_are_no_miss():
    out = with_received(TIERS_SAY, received_tokens(LOADED))
    assert out["num_lmcache_cached_tokens"] == 867
    usage = out["kvlens"]
    assert usage["hit_tokens"] == 867 and usage["loaded_tokens"] == {"pd": 867}
    assert usage["miss_reason"] is None and "miss_detail" not in usage
    assert TIERS_SAY["kvlens"]["miss_reason"] == "not_stored"  # the tiers' answer is not changed in place


def test_vllms_own_hit_and_the_received_tokens_add_up():
    params = {**TIERS_SAY, "kvlens": {**TIERS_SAY["kvlens"], "vllm_cached_tokens": 128}}
    out = with_received(params, 739)  # PD loaded what vLLM did not hold
    assert out["num_lmcache_cached_tokens"] == 867 and out["kvlens"]["hit_tokens"] == 867


def test_a_failed_or_absent_pd_load_counts_nothing():
    for pd in (None, {**LOADED, "outcome": "failed", "tokens": 0}, {**LOADED, "outcome": "none"}):
        assert received_tokens(pd) == 0
        assert with_received(TIERS_SAY, received_tokens(pd)) == TIERS_SAY
    assert received_tokens({**LOADED, "role": "sender"}) == 0  # a prefiller's sent tokens are not hits


def test_the_request_log_counts_them_too():
    line = RequestSummary("d-1", 868, 0, {}, MissReason.NOT_STORED, None, None, 0, 0, (), None)
    said = summary_with_received(line, 867)
    assert said.loaded_tokens == {"pd": 867} and said.miss_reason is None
    assert summary_with_received(line, 0) is line
