import subprocess
import sys
from pathlib import Path

from connector.engine.keys import Namespace, PrefixHasher, chunk_keys, parse_tags

NS = Namespace("m", "bfloat16", "layout-a")


def test_chunk_key_depends_on_every_earlier_token():
    a = chunk_keys(NS, list(range(512)), 256, include_partial=False)
    b = chunk_keys(NS, [999] + list(range(1, 512)), 256, include_partial=False)
    assert a[0].digest != b[0].digest
    assert a[1].digest != b[1].digest  # second chunk's tokens are equal, its prefix is not


def test_keys_cover_whole_chunks_and_optional_partial_tail():
    tokens = list(range(600))
    full = chunk_keys(NS, tokens, 256, include_partial=False)
    with_tail = chunk_keys(NS, tokens, 256, include_partial=True)
    assert [(k.start, k.num_tokens) for k in full] == [(0, 256), (256, 256)]
    assert [(k.start, k.num_tokens) for k in with_tail] == [(0, 256), (256, 256), (512, 88)]
    assert with_tail[:2] == full


def test_partial_tail_key_differs_from_a_longer_tail():
    short = chunk_keys(NS, list(range(300)), 256, include_partial=True)[-1]
    longer = chunk_keys(NS, list(range(301)), 256, include_partial=True)[-1]
    assert short.digest != longer.digest


def test_everything_that_changes_kv_changes_the_key():
    tokens = list(range(256))
    base = chunk_keys(NS, tokens, 256, False)[0].digest
    variants = [
        Namespace("other-model", "bfloat16", "layout-a"),
        Namespace("m", "float16", "layout-a"),
        Namespace("m", "bfloat16", "layout-b"),
        Namespace("m", "bfloat16", "layout-a", world_size=2),
        NS.with_request("adapter-1", None, {}),
        NS.with_request(None, "tenant-salt", {}),
        NS.with_request(None, None, {"user": "alice"}),
    ]
    digests = {chunk_keys(ns, tokens, 256, False)[0].digest for ns in variants}
    assert base not in digests and len(digests) == len(variants)


def test_keys_are_stable_across_processes():
    code = (
        "from connector.engine.keys import Namespace, chunk_keys;"
        "print(chunk_keys(Namespace('m','bfloat16','layout-a'), list(range(300)), 256, True)[-1].hex)"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            cwd=Path(__file__).parents[2],
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {chunk_keys(NS, list(range(300)), 256, True)[-1].hex}


def test_prefix_hasher_matches_one_shot_hashing_as_tokens_grow_and_roll_back():
    tokens = list(range(1000))
    hasher = PrefixHasher(NS, 256)
    for n in (100, 300, 800, 1000, 400, 1000):
        assert hasher.keys(tokens[:n], True) == chunk_keys(NS, tokens[:n], 256, True)
        assert hasher.keys(tokens, True, upto=n) == chunk_keys(NS, tokens[:n], 256, True)


class CountingTokens(list):
    """A token list that counts how many token positions were read."""

    read = 0

    def __getitem__(self, i):
        out = super().__getitem__(i)
        CountingTokens.read += len(out) if isinstance(i, slice) else 1
        return out


def test_prefix_hasher_reads_each_token_once_however_often_it_is_asked():
    tokens = CountingTokens(range(32768))
    hasher = PrefixHasher(NS, 256)
    CountingTokens.read = 0
    for upto in range(256, 32769, 256):
        hasher.extend(tokens, upto)
    assert CountingTokens.read == 32768
    hasher.extend(tokens, 32768)
    hasher.full_keys(32000, 32768)
    assert CountingTokens.read == 32768


def test_tags_must_be_strings():
    assert parse_tags({"lmcache.tag.user": "a", "other": 1}) == {"user": "a"}
    try:
        parse_tags({"lmcache.tag.user": {"x": 1}})
    except ValueError as e:
        assert "lmcache.tag.user" in str(e)
    else:
        raise AssertionError("a dict tag must be rejected")


def test_tags_that_join_to_the_same_text_are_different_namespaces():
    """Found by test_engine_properties: v1 hashed a tag as "name=value", so these two collided."""
    a = NS.with_request(None, None, {"a=b": "c"})
    b = NS.with_request(None, None, {"a": "b=c"})
    assert chunk_keys(a, [1], 1, True) != chunk_keys(b, [1], 1, True)


def test_untagged_keys_are_unchanged_by_the_tag_encoding():
    """Chunks stored before tags got their own encoding stay reachable."""
    assert chunk_keys(NS, list(range(4)), 2, False)[0].hex == "622b18267c4051312c40973f8c3a9028"
