"""Every configuration docs/coming-from-lmcache.md shows loads, and its counts match the corpus."""

from __future__ import annotations

import json
import logging
import re
import shlex
from collections import Counter
from pathlib import Path

import pytest

from connector.config.loading import load_config

from .test_config_lmcache_corpus import EXPECTED

PAGE = Path(__file__).resolve().parents[2] / "docs" / "coming-from-lmcache.md"
BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.S)


def blocks(kind: str) -> list[str]:
    return [body for lang, body in BLOCK.findall(PAGE.read_text()) if lang == kind]


def shell_sources(script: str) -> tuple[dict, dict]:
    """``export NAME=value`` and ``NAME=value command`` assignments, and --kv-transfer-config's JSON."""
    words = shlex.split(script.replace("\\\n", " "), comments=True)
    env: dict[str, str] = {}
    extra: dict = {}
    for i, word in enumerate(words):
        if re.fullmatch(r"LMCACHE_[A-Z_]+=.*", word) and word.split("=")[0] != "LMCACHE_CONFIG_FILE":
            name, _, value = word.partition("=")
            env[name] = value
        if word == "--kv-transfer-config":
            extra = json.loads(words[i + 1]).get("kv_connector_extra_config", {})
    return env, extra


def kv_transfer_configs() -> list[dict]:
    """The extra config of every --kv-transfer-config the page's shell examples pass to vLLM."""
    return [extra for b in blocks("bash") if "--kv-transfer-config" in b for extra in [shell_sources(b)[1]]]


def test_the_page_has_yaml_kv_transfer_config_and_shell_examples():
    assert len(blocks("yaml")) >= 3 and len(kv_transfer_configs()) >= 1 and len(blocks("bash")) >= 2


@pytest.mark.parametrize("text", blocks("yaml"))
def test_every_yaml_example_loads(text, tmp_path):
    path = tmp_path / "lmcache.yaml"
    path.write_text(text)
    load_config({}, env={"LMCACHE_CONFIG_FILE": str(path)})


@pytest.mark.parametrize("script", blocks("bash"))
def test_every_shell_example_loads(script):
    env, extra = shell_sources(script)
    load_config(extra, env=env)


def test_the_complete_example_starts_without_a_warning_and_does_what_it_says(
    tmp_path, caplog, disk_with_room
):
    text = next(b for b in blocks("yaml") if b.startswith("# lmcache.yaml"))
    path = tmp_path / "lmcache.yaml"
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="vllm.kvlens"):
        config = load_config({}, env={"LMCACHE_CONFIG_FILE": str(path)})
    assert caplog.records == [] and config.tier_names() == ("cpu", "disk", "remote")
    assert config.cache_policy == "LFU" and config.extra_config.tag_keys == ("user",)
    env, extra = shell_sources(next(b for b in blocks("bash") if "export LMCACHE_CHUNK_SIZE" in b))
    from_env = load_config({}, env=env)
    from_json = load_config(next(c for c in kv_transfer_configs() if "lmcache.cache_policy" in c), env={})
    for other in (from_env, from_json):
        assert (other.cache_policy, other.extra_config.tag_keys) == ("LFU", ("user",))
        assert other.remote.redacted() == config.remote.redacted()


def test_the_counts_on_the_page_are_the_corpus_counts():
    tally = Counter(e.outcome for e in EXPECTED.values())
    unknown = sum(
        1 for e in EXPECTED.values() if e.outcome == "refused" and "unknown key" in " ".join(e.words)
    )
    text = " ".join(PAGE.read_text().split())
    assert (
        f"Of {len(EXPECTED)} configurations taken from LMCache's examples, CI and documentation" in text
        and f"{tally['starts']} start as they are, {tally['warns']} start with the warning and "
        f"{tally['refused']} are refused ({tally['refused'] - unknown} for a feature KVLens lacks, "
        f"{unknown} for an unknown key)"
        in text
    )
