"""Namespace records describe a namespace without its secrets, and selectors pick namespaces."""

import json

import pytest

from connector.engine.keys import Namespace, key_fingerprint
from connector.engine.namespace_records import NamespaceRecord, Selector, select

from .fakes import IDENTITY

BASE = Namespace(IDENTITY.key(), "bfloat16", "layout-1", 2)
SALTED = BASE.with_request(None, "tenant-secret", {})
TAGGED = BASE.with_request(None, None, {"team": "blue-secret"})
BOTH = BASE.with_request("adapter:abc", "tenant-secret", {"team": "blue-secret", "app": "x"})
OTHER_MODEL = Namespace("named:llama-70b|c|bfloat16|fp8|auto", "bfloat16", "layout-1", 2)


def test_a_record_holds_every_part_of_the_key_but_salts_and_tag_values():
    record = NamespaceRecord.of(BOTH, chunk_size=256)
    raw = record.to_json()
    assert b"secret" not in raw and b"tenant" not in raw
    assert record.fingerprint == key_fingerprint(BOTH)
    assert record.salted and sorted(record.tag_names) == ["app", "team"] and record.lora == "adapter:abc"
    assert NamespaceRecord.from_json(raw) == record
    assert record.identity == IDENTITY and record.weights == IDENTITY.weights


def test_a_named_model_with_a_bar_in_its_name_still_splits_into_its_identity():
    ns = Namespace("named:a|b|cfg|bfloat16|none|auto", "bfloat16", "L")
    assert NamespaceRecord.of(ns).identity.weights == "named:a|b"


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b.update(fingerprint="xyz"),
        lambda b: b.update(world_size="2"),
        lambda b: b.update(salted=1),
        lambda b: b.update(kvlens_namespace=2),
        lambda b: b.update(tag_names=[1]),
        lambda b: b.update(model="something else"),  # unsalted, untagged: it must add up
        lambda b: b.pop("dtype"),
    ],
)
def test_malformed_or_inconsistent_records_are_refused(damage):
    body = json.loads(NamespaceRecord.of(BASE).to_json())
    damage(body)
    with pytest.raises(ValueError):
        NamespaceRecord.from_json(json.dumps(body))


def test_refuses_what_is_not_a_record():
    for raw in (b"[]", b"not json", b"{}", b"[" * 100000):
        with pytest.raises(ValueError):
            NamespaceRecord.from_json(raw)


RECORDS = [NamespaceRecord.of(ns) for ns in (BASE, SALTED, TAGGED, BOTH, OTHER_MODEL)]
FP = {name: key_fingerprint(ns) for name, ns in [("base", BASE), ("salted", SALTED), ("tagged", TAGGED)]}


def test_a_salt_picks_exactly_the_namespace_keyed_with_it():
    assert select(RECORDS, Selector(salt="tenant-secret")) == {FP["salted"]}
    assert select(RECORDS, Selector(salt="another-tenant")) == set()


def test_tags_pick_the_namespace_with_exactly_those_tags_and_values():
    assert select(RECORDS, Selector(tags=(("team", "blue-secret"),))) == {FP["tagged"]}
    assert select(RECORDS, Selector(tags=(("team", "red"),))) == set()
    both = Selector(salt="tenant-secret", tags=(("app", "x"), ("team", "blue-secret")))
    assert select(RECORDS, both) == {key_fingerprint(BOTH)}


def test_a_model_picks_every_namespace_of_those_weights():
    digest = IDENTITY.weights.split(":", 1)[1]
    for given in (IDENTITY.weights, digest, digest[:8], IDENTITY.key()):
        assert select(RECORDS, Selector(model=given)) == {r.fingerprint for r in RECORDS[:4]}, given
    assert select(RECORDS, Selector(model="llama-70b")) == {key_fingerprint(OTHER_MODEL)}
    assert select(RECORDS, Selector(model=digest[:5])) == set()  # too short to be a digest prefix


def test_fingerprints_match_whole_or_by_a_long_enough_prefix_and_criteria_combine():
    fp = FP["salted"]
    assert select(RECORDS, Selector(frozenset({fp}))) == {fp}
    assert select(RECORDS, Selector(frozenset({fp[:6]}))) == {fp}
    assert select(RECORDS, Selector(frozenset({fp[:5]}))) == set()
    assert select(RECORDS, Selector(frozenset({fp}), model="llama-70b")) == set()


def test_chunks_of_a_namespace_without_a_record_are_taken_by_fingerprint_only():
    selector = Selector(frozenset({"abcdef123456"}))
    assert selector.takes("abcdef123456", set()) and not selector.takes("abcdef000000", set())
    assert not Selector(model="x").takes("abcdef123456", set())
    assert not Selector(model="x").takes("", {""})  # a chunk of unknown namespace: only "everything"
    assert Selector().takes("", set())


def test_selector_requests_must_say_what_to_clear_and_name_bad_fields():
    assert Selector.from_json({"all": True}).everything
    assert Selector.from_json({"salt": "s", "tags": {"a": "b"}}) == Selector(salt="s", tags=(("a", "b"),))
    for body, word in [
        ({}, "say what"),
        ({"namespaces": ["xyz"]}, "namespaces"),
        ({"model": ""}, "model"),
        ({"tags": {"a": 1}}, "tags"),
        ({"colour": "red"}, "colour"),
    ]:
        with pytest.raises(ValueError, match=word):
            Selector.from_json(body)
    assert "secret" not in Selector(salt="secret", tags=(("t", "secret"),)).describe()
