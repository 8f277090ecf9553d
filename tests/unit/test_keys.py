import hashlib
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from connector.engine.keys import (
    Namespace,
    PrefixHasher,
    block_aligned_keys,
    chain,
    chunk_keys,
    first_chunk_fingerprint,
    key_fingerprint,
    parse_tags,
)

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


def test_untagged_seeds_are_unchanged_by_the_tag_encoding():
    """Tags got their own encoding without moving the namespaces that have none."""
    assert NS.seed().hex() == "96f2cb9c4a9357a47a0bcdc3c67691fd"


PARENT = bytes(range(16))


def test_a_key_is_blake2b_of_its_parent_and_its_ids_as_little_endian_integers():
    """The v2 layout, written out: 4 bytes an id when all fit in 32 bits, else 8 (signed)."""

    def blake(person: bytes, data: bytes) -> bytes:
        return hashlib.blake2b(data, digest_size=16, person=person).digest()

    assert chain(PARENT, [1, 70000, 2**32 - 1]) == blake(
        b"kvlens-chunk-v2", PARENT + struct.pack("<3I", 1, 70000, 2**32 - 1)
    )
    assert chain(PARENT, [1, 2**32, -1]) == blake(
        b"kvlens-chunk-v2w", PARENT + struct.pack("<3q", 1, 2**32, -1)
    )
    keys = chunk_keys(NS, [3, 1, 4, 2**40], 2, False)  # the same on every machine and in every process
    assert [k.hex for k in keys] == ["518f798ab4d020efc507b1bdd04591fc", "a4c5f8686d6b30d0ca4dbf489828622a"]


def test_4_byte_and_8_byte_ids_never_give_the_same_key():
    """[0, 1] in 4-byte ids and [2**32] in 8-byte ids are the same bytes: only the width's own
    person string keeps their keys apart."""
    assert struct.pack("<2I", 0, 1) == struct.pack("<q", 2**32)
    assert chain(PARENT, [0, 1]) != chain(PARENT, [2**32])
    assert chain(PARENT, [1, 1]) != chain(PARENT, [1 + 2**32])
    assert chain(PARENT, [5]) != chain(PARENT, [5, 0])


def test_ids_of_more_than_32_bits_hash_and_only_their_chunk_changes_width():
    small = chunk_keys(NS, [5] * 4 + [6] * 4 + [7] * 4, 4, True)
    big = chunk_keys(NS, [5] * 4 + [6, 2**40, 6, 6] + [7] * 4, 4, True)
    assert big[0] == small[0] and big[1] != small[1] and big[2] != small[2]
    hasher = PrefixHasher(NS, 4)
    assert hasher.keys([5] * 4 + [6, 2**40, 6, 6] + [7] * 4, True) == big
    assert chunk_keys(NS, [2**63 - 1, -(2**63)], 2, False)  # the whole signed 64-bit range
    with pytest.raises(OverflowError):  # never wrapped onto another id
        chunk_keys(NS, [2**63], 1, False)


@pytest.mark.parametrize("big_at", [None, 0, 5, 12])
def test_block_aligned_keys_are_the_keys_of_each_whole_block_prefix(big_at):
    tokens = list(range(100, 116))
    if big_at is not None:
        tokens[big_at] = 2**33  # prefixes before it stay 4-byte, those after go 8-byte
    keys = block_aligned_keys(PARENT, tokens, 32, 16, 4)
    assert [(k.start, k.num_tokens) for k in keys] == [(32, 12), (32, 8), (32, 4)]
    assert [k.digest for k in keys] == [chain(PARENT, tokens[:n]) for n in (12, 8, 4)]
    assert block_aligned_keys(PARENT, tokens[:7], 32, 16, 4) == keys[-1:]


def test_the_first_chunk_fingerprint_is_hashed_once_per_request():
    tokens = CountingTokens(range(600))
    hasher = PrefixHasher(NS, 256)
    CountingTokens.read = 0
    assert hasher.fingerprint(tokens) == first_chunk_fingerprint(list(range(600)), 256)
    assert hasher.fingerprint(tokens) is hasher.fingerprint(tokens)
    assert CountingTokens.read == 256
    assert first_chunk_fingerprint(tokens, 256) not in {k.digest for k in chunk_keys(NS, tokens, 256, True)}


def test_the_key_fingerprint_tells_v1_engines_apart():
    """A v1 engine reported its seed's first 12 hex digits; it shares no key with a v2 engine."""
    assert len(key_fingerprint(NS)) == 12 and key_fingerprint(NS) != NS.seed().hex()[:12]
    assert key_fingerprint(NS) == key_fingerprint(Namespace("m", "bfloat16", "layout-a"))
    assert key_fingerprint(NS) != key_fingerprint(Namespace("m", "bfloat16", "layout-b"))
