"""Property-based tests: bad input of any shape is refused cleanly, never an exception that escapes.

Three inputs reach KVLens from outside: the configuration (at start-up), each request's
``kv_transfer_params`` (inside vLLM's scheduler, where an exception kills the engine) and the
bytes a disk or remote tier hands back (inside the worker). Each property says what the only
allowed outcomes are.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connector.config.loading import LMCACHE_KEYS_NOT_USED, ConfigError, KVLensConfig, load_config
from connector.engine.keys import Namespace
from connector.engine.outcomes import MissReason
from connector.engine.policy import RequestPolicy, decide_policy
from connector.tiers import codec
from connector.tiers.base import ChunkCorrupt, ChunkMissing, classify
from connector.tiers.disk import DiskTier

PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---- values of every shape a JSON body, a YAML file or a Python caller can produce ----------
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(4400, 6000).map(lambda digits: 10**digits),  # past Python's int-to-str limit
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.binary(max_size=16),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)


def _deeply_nested(depth: int) -> object:
    value: object = "x"
    for _ in range(depth):
        value = {"k": [value]}
    return value


values = st.one_of(json_values, st.integers(100, 3000).map(_deeply_nested))

known_keys = sorted(KVLensConfig.model_fields) + sorted(LMCACHE_KEYS_NOT_USED)[:10]
extra_keys = sorted(KVLensConfig.model_fields["extra_config"].annotation.model_fields)
config_keys = st.one_of(
    st.sampled_from(known_keys).map(lambda k: "lmcache." + k),
    st.sampled_from(extra_keys).map(lambda k: "lmcache.extra_config." + k),
    st.just("lmcache.extra_config"),
    st.sampled_from(["discard_partial_chunks", "skip_last_n_tokens"]),
    st.text(max_size=20).map(lambda k: "lmcache." + k),
    st.text(max_size=20),
    st.integers(),
)
config_values = st.one_of(
    values,
    st.sampled_from(["true", "false", "1", "-1", "0.5", "inf", "nan", "1e400", "{", "[", "redis://h:1"]),
    st.just("1" * 5000),  # an integer past Python's int-to-str digit limit
)
# Strings nested past the parsers' recursion limits cost ~1 s each to refuse (YAML unwinds a
# deep stack), so they are fixed examples in test_hostile_config_is_a_config_error, not drawn.


@PROPERTY
@given(st.dictionaries(config_keys, config_values, max_size=6))
def test_any_extra_config_parses_to_a_usable_config_or_raises_config_error(extra):
    try:
        config = load_config(extra, env={})
    except ConfigError as e:
        assert str(e)  # names the problem
        return
    # A config that parsed is usable: every derived value the connector reads can be computed.
    assert config.cpu_budget_bytes >= 0 and config.disk_budget_bytes >= 0
    assert config.tier_names()
    config.summary()
    config.check_block_size(16) if config.chunk_size % 16 == 0 else None


env_names = st.one_of(
    st.sampled_from(known_keys).map(lambda k: "LMCACHE_" + k.upper()),
    st.sampled_from(extra_keys).map(lambda k: "LMCACHE_EXTRA_CONFIG." + k.upper()),
    st.sampled_from(["LMCACHE_EXTRA_CONFIG", "LMCACHE_FORCE_SKIP_SAVE"]),
    st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ_.", max_size=12).map(lambda k: "LMCACHE_" + k),
)
env_values = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["true", "1", "-1", "null", "~", "{a: 1}", "[1, 2]", "{", "!!binary x", "1e400"]),
    st.just("1" * 5000),  # an integer past Python's int-to-str digit limit
)


@PROPERTY
@given(st.dictionaries(env_names, env_values, max_size=4))
def test_any_environment_parses_to_a_config_or_raises_config_error(env):
    try:
        load_config({}, env=env)
    except ConfigError as e:
        assert str(e)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.one_of(
        st.text(max_size=80),
        env_values,
        st.sampled_from(["1: 2", "~: 2", "[a]: 1", "- 1", "a: !!python/name:os.system"]),
    )
)
def test_any_yaml_file_parses_to_a_config_or_raises_config_error(tmp_path, text):
    path = tmp_path / "kvlens.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        load_config({}, env={"LMCACHE_CONFIG_FILE": str(path)})
    except ConfigError as e:
        assert str(e)


DEEP = "[" * 100_000
BIG_INT = "1" * 5000


@pytest.mark.parametrize(
    ("extra", "env", "yaml_text"),
    [
        ({}, {"LMCACHE_CHUNK_SIZE": DEEP}, None),  # was RecursionError from yaml
        ({}, {"LMCACHE_CHUNK_SIZE": BIG_INT}, None),  # was ValueError (int digit limit) from yaml
        ({}, {"LMCACHE_EXTRA_CONFIG": BIG_INT}, None),  # was ValueError, after json.loads gave up
        ({"lmcache.extra_config": DEEP}, {}, None),  # was RecursionError from json
        ({"lmcache.extra_config": "x", "lmcache.extra_config.foo": 1}, {}, None),  # was TypeError
        ({"lmcache.extra_config": [1], "lmcache.extra_config.foo": 1}, {}, None),  # was TypeError
        ({}, {}, "chunk_size: " + DEEP),  # was RecursionError
        ({}, {}, "chunk_size: " + BIG_INT),  # was ValueError
        ({}, {}, "1: 2"),  # was AttributeError: 'int' object has no attribute 'strip'
        ({}, {}, "~: 2"),  # was AttributeError on None
    ],
)
def test_hostile_config_is_a_config_error(tmp_path, extra, env, yaml_text):
    if yaml_text is not None:
        path = tmp_path / "kvlens.yaml"
        path.write_text(yaml_text, encoding="utf-8")
        env = {**env, "LMCACHE_CONFIG_FILE": str(path)}
    with pytest.raises(ConfigError):
        load_config(extra, env=env)


# ---- per-request kv_transfer_params ---------------------------------------------------------
BASE = Namespace("model", "bf16", "layout")
param_keys = st.one_of(
    st.sampled_from(["lmcache.skip_save", "lmcache.tag.user", "lmcache.tag.", "lmcache.tag.team"]),
    st.text(max_size=20).map(lambda k: "lmcache." + k),
    st.text(max_size=20).map(lambda k: "lmcache.tag." + k),
    st.text(max_size=20),
    st.integers(),
    st.none(),
)
params = st.one_of(st.dictionaries(param_keys, values, max_size=6), values)


def _decide(kv_transfer_params: object) -> RequestPolicy:
    return decide_policy(BASE, "req-1", kv_transfer_params, None, None, 0, False, "kv_both", None, False)


@PROPERTY
@given(params)
def test_any_kv_transfer_params_give_a_policy_never_an_exception(kv_transfer_params):
    policy = _decide(kv_transfer_params)
    assert isinstance(policy, RequestPolicy)
    if policy.namespace is None:
        assert policy.skip_reason is MissReason.INVALID_PARAMS  # counted as a miss reason


@PROPERTY
@given(st.dictionaries(st.text(max_size=20), st.text(max_size=40), min_size=1, max_size=4))
def test_well_formed_tags_are_honoured(tags):
    policy = _decide({"lmcache.tag." + k: v for k, v in tags.items()})
    assert policy.namespace is not None and dict(policy.namespace.tags) == tags


@PROPERTY
@given(
    st.text(max_size=20).filter(lambda k: k != "skip_save" and not k.startswith("tag.")),
    values,
)
def test_other_lmcache_keys_leave_caching_and_tags_as_they_are(key, value):
    """LMCache clients send keys KVLens has no use for; the request keeps its cache and its tags."""
    policy = _decide({"lmcache." + key: value, "lmcache.tag.user": "alice"})
    assert policy.namespace is not None and dict(policy.namespace.tags) == {"user": "alice"}
    assert policy.skip_reason is None and policy.save_skip_reason is None


def test_non_lmcache_keys_are_left_to_other_connectors():
    policy = _decide({"do_remote_prefill": True, "remote_host": {"deep": [1, 2]}})
    assert policy.namespace is not None


# ---- the tier record format -----------------------------------------------------------------
NAME = "ab" * 16 + ".r0"
LAYOUT = "layout-1"


def _valid_record(payload: bytes) -> bytearray:
    return bytearray(codec.encode_header(NAME, LAYOUT, memoryview(payload)) + payload)


def _mutate(record: bytearray, data: st.DataObject) -> bytes:
    kind = data.draw(st.sampled_from(["truncate", "flip", "splice", "extend", "header"]))
    if kind == "truncate":
        return bytes(record[: data.draw(st.integers(0, len(record)))])
    if kind == "flip":
        at = data.draw(st.integers(0, len(record) - 1))
        record[at] ^= data.draw(st.integers(1, 255))
        return bytes(record)
    if kind == "splice":
        at = data.draw(st.integers(0, len(record)))
        return bytes(record[:at]) + data.draw(st.binary(max_size=64)) + bytes(record[at:])
    if kind == "extend":
        return bytes(record) + data.draw(st.binary(min_size=1, max_size=64))
    header = data.draw(st.sampled_from([b"[]", b"1", b'"s"', b"null", b"{}", b"[" * 5000, b"\xff\xfe"]))
    header = data.draw(st.one_of(st.just(header), st.binary(max_size=64)))
    return codec.MAGIC + len(header).to_bytes(4, "little") + header + record[-8:]


def _check_decode(record: bytes, payload: bytes | None) -> None:
    try:
        got = codec.decode(bytearray(record), NAME, LAYOUT)
    except ChunkCorrupt as e:
        classify(e)
        return
    assert payload is not None, "a damaged record was accepted"
    assert bytes(got) == payload


def _record_with_header(header: bytes, payload: bytes = b"kv") -> bytearray:
    return bytearray(codec.MAGIC + len(header).to_bytes(4, "little") + header + payload)


@pytest.mark.parametrize(
    "header",
    [
        b"[" * 100_000,  # was RecursionError from json, escaping the worker's load
        b"[]",  # was AttributeError: 'list' object has no attribute 'get'
        b'"KVLENS"',
        b"null",
        b"1" * 5000,  # int past the digit limit: ValueError, caught as unreadable
    ],
)
def test_a_header_that_is_not_a_json_object_is_corrupt(header):
    with pytest.raises(ChunkCorrupt):
        codec.decode(_record_with_header(header), NAME, LAYOUT)


@PROPERTY
@given(st.binary(max_size=256))
def test_arbitrary_bytes_are_never_a_chunk(record):
    _check_decode(record, None)
    _check_decode(codec.MAGIC + record, None)


@PROPERTY
@given(st.binary(min_size=1, max_size=256), st.data())
def test_damaged_records_are_rejected_and_intact_ones_read_back(payload, data):
    record = _valid_record(payload)
    _check_decode(bytes(record), payload)
    damaged = _mutate(bytearray(record), data)
    _check_decode(damaged, payload if damaged == bytes(record) else None)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=200))
def test_disk_tier_turns_any_file_into_a_chunk_or_a_classified_failure(tmp_path, content):
    tier = DiskTier(str(tmp_path), LAYOUT)
    os.makedirs(os.path.dirname(tier.path(NAME)), exist_ok=True)
    with open(tier.path(NAME), "wb") as f:
        f.write(content)
    try:
        tier.get(NAME)
    except (ChunkCorrupt, ChunkMissing) as e:
        classify(e)
        assert not os.path.exists(tier.path(NAME))  # a corrupt file is removed when read
    else:
        raise AssertionError("random bytes were accepted as a chunk")
