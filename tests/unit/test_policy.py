from connector.engine.keys import Namespace
from connector.engine.outcomes import MissReason, SaveSkipReason
from connector.engine.policy import decide_policy, trace_headers

BASE = Namespace("m", "bf16", "layout")


def policy(params=None, **kw):
    args = dict(
        lora_name=None,
        cache_salt=None,
        priority=0,
        has_unsupported_input=False,
        kv_role="kv_both",
        priority_limit=None,
        force_skip_save=False,
    )
    args.update(kw)
    return decide_policy(BASE, "r", params, **args)


def test_only_w3c_headers_are_taken_from_a_request():
    class Req:
        trace_headers = {"traceparent": "00-x-y-01", "tracestate": "a=b", "authorization": "secret"}

    assert trace_headers(Req()) == {"traceparent": "00-x-y-01", "tracestate": "a=b"}
    assert trace_headers(object()) is None


def test_malformed_request_parameters_bypass_kvlens_for_that_request_only():
    for params in ({"lmcache.tag.user": ["x"]}, {"lmcache.skip_save": "maybe"}, {"lmcache.tag.t": {"a": 1}}):
        p = policy(params)
        assert p.namespace is None and p.skip_reason is MissReason.INVALID_PARAMS
    assert (
        policy("not a mapping").namespace is not None
    )  # vLLM passes None or a dict; anything else: no params


def test_save_skip_reasons():
    assert policy(kv_role="kv_consumer").save_skip_reason is SaveSkipReason.CONSUMER_ROLE
    assert policy({"lmcache.skip_save": 1}).save_skip_reason is SaveSkipReason.SKIP_SAVE
    assert policy(priority=9, priority_limit=5).save_skip_reason is SaveSkipReason.PRIORITY_LIMIT
    assert policy(has_unsupported_input=True).skip_reason is MissReason.UNSUPPORTED_INPUT
