"""LMCache's extra_config.tag_keys: named kv_transfer_params entries become key tags."""

import pytest

from connector.engine.keys import Namespace
from connector.engine.outcomes import MissReason
from connector.engine.policy import decide_policy, request_tags

BASE = Namespace("m", "bf16", "layout")


def namespace(params, tag_keys=("user",)):
    policy = decide_policy(BASE, "r", params, None, None, 0, False, "kv_both", None, False, tag_keys)
    return policy


def test_a_named_entry_becomes_the_tag_of_the_same_name():
    assert request_tags({"user": "alice", "other": "x"}, ("user",)) == {"user": "alice"}
    assert request_tags({"user": 7}, ("user",)) == {"user": "7"}


def test_it_is_the_same_tag_as_lmcache_tag_name():
    by_key = namespace({"user": "alice"}).namespace
    by_tag = namespace({"lmcache.tag.user": "alice"}, tag_keys=()).namespace
    assert by_key == by_tag and by_key.seed() == by_tag.seed()


def test_requests_with_other_values_or_none_never_share_keys():
    seeds = {
        namespace({"user": "alice"}).namespace.seed(),
        namespace({"user": "bob"}).namespace.seed(),
        namespace({}).namespace.seed(),
    }
    assert len(seeds) == 3


def test_without_tag_keys_the_entry_is_not_a_tag():
    assert namespace({"user": "alice"}, tag_keys=()).namespace.seed() == BASE.seed()


@pytest.mark.parametrize("empty", [None, "", 0, False])
def test_an_empty_value_makes_no_tag_as_in_lmcache(empty):
    assert request_tags({"user": empty}, ("user",)) == {}


@pytest.mark.parametrize(
    "params",
    [{"user": ["a"]}, {"user": {"a": 1}}, {"user": True}, {"user": "a", "lmcache.tag.user": "b"}],
)
def test_a_malformed_or_conflicting_tag_serves_the_request_without_kvlens(params):
    policy = namespace(params)
    assert policy.namespace is None and policy.skip_reason is MissReason.INVALID_PARAMS


def test_the_same_value_twice_is_one_tag():
    assert request_tags({"user": "a", "lmcache.tag.user": "a"}, ("user",)) == {"user": "a"}
