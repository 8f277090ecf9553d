"""Every fenced block in README.md and docs/ is checked as what it claims to be.

Info strings say what a block is: ``bash`` (commands: their scripts, modules and flags exist,
their KVLens configurations load), ``python`` (compiles; the offline ``LLM`` snippet also runs,
in test_offline_snippet.py), ``yaml`` (a KVLens config file that loads; ``yaml invalid`` must be
refused), ``json sample=<what>`` (an output sample, checked against the code that writes it),
``promql`` (metric names exist, promtool parses it), ``mermaid`` (a diagram: the files it names
exist) and ``text`` (output shown, not checked).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from connector.config.loading import ConfigError, load_config

from . import markdown as md
from .samples import SAMPLE_CHECKS

KNOWN_LANGS = {"bash", "python", "yaml", "json", "promql", "text", "mermaid"}
# Commands that are not ours and need no check beyond their --kv-transfer-config (vllm) or -d body.
EXTERNAL = {"curl", "export", "vllm"}
# python -m targets whose --help would import vLLM's CLI (12 s on the 2-core machine); the serve
# tests start servers through them, so existence is checked here, not start-up.
SLOW_HELP = {"connector.launcher"}

BLOCKS = md.all_blocks()


def of(lang: str) -> list[md.Block]:
    return [b for b in BLOCKS if b.lang == lang]


def ids(blocks: list[md.Block]) -> list[str]:
    return [b.where for b in blocks]


def shell_commands() -> list[tuple[md.Block, list[str]]]:
    return [(b, words) for b in of("bash") for words in md.commands(b)]


def test_every_block_says_what_it_is():
    unknown = [(b.where, b.lang) for b in BLOCKS if b.lang not in KNOWN_LANGS]
    assert not unknown, "fenced blocks need an info string the docs tests know"


def test_diagrams_name_files_that_exist():
    blocks = of("mermaid")
    assert blocks, "docs/how-it-works.md opens with a diagram"
    for b in blocks:
        names = re.findall(r"[\w/]+\.py", b.text)
        missing = [n for n in names if not any((md.REPO / "connector").glob(f"**/{n}"))]
        assert names and not missing, (b.where, missing)


def test_json_blocks_are_output_samples_the_tests_know():
    for b in of("json"):
        assert b.tags.get("sample") in SAMPLE_CHECKS, (
            f"{b.where}: json needs sample=<{'|'.join(SAMPLE_CHECKS)}>"
        )


@pytest.mark.parametrize("block", of("json"), ids=ids(of("json")))
def test_output_samples_match_what_kvlens_writes(block):
    SAMPLE_CHECKS[block.tags["sample"]](json.loads(block.text))


@pytest.mark.parametrize("block", of("yaml"), ids=ids(of("yaml")))
def test_yaml_configs_load_and_invalid_ones_are_refused(block, tmp_path):
    path = tmp_path / "kvlens.yaml"
    path.write_text(block.text)
    env = {"LMCACHE_CONFIG_FILE": str(path)}
    if "invalid" not in block.tags:
        load_config({}, env)
        return
    with pytest.raises(ConfigError) as refused:
        load_config({}, env)
    shown = next((b for b in BLOCKS if b.path == block.path and b.line > block.line), None)
    if shown is not None and shown.lang == "text" and shown.text.startswith("KVLens cannot start"):
        message = str(refused.value).replace(str(path), path.name)
        assert shown.text.strip() == message, f"{shown.where} shows another message"


@pytest.mark.parametrize("block", of("python"), ids=ids(of("python")))
def test_python_snippets_compile(block):
    compile(block.text, block.where, "exec")


def test_kv_transfer_configs_are_valid_for_vllm_and_kvlens():
    from vllm.config import KVTransferConfig

    found = 0
    for block, words in shell_commands():
        raw = md.option_value(words, "--kv-transfer-config")
        if raw is None:
            continue
        found += 1
        config = json.loads(raw)
        KVTransferConfig(**config)
        assert config["kv_connector"] == "KVLensConnector", block.where
        load_config(config.get("kv_connector_extra_config", {}), env={})
    assert found >= 4


def test_exported_lmcache_variables_load():
    exported = {}
    for _, words in shell_commands():
        if words[0] == "export":
            exported.update(md.env_prefix(words[1:])[0])
    settings = {k: v for k, v in exported.items() if k.startswith("LMCACHE_")}
    assert settings, "configuration.md shows LMCACHE_<KEY> variables"
    load_config({}, settings)


def test_the_same_settings_three_ways_are_the_same(tmp_path):
    """configuration.md shows one configuration as a YAML file, variables and extra config."""
    page = md.DOCS / "configuration.md"
    yaml_file = tmp_path / "kvlens.yaml"
    yaml_file.write_text(next(b for b in md.blocks(page) if b.lang == "yaml").text)
    shell = [words for b in md.blocks(page) if b.lang == "bash" for words in md.commands(b)]
    env = {k: v for w in shell if w[0] == "export" for k, v in md.env_prefix(w[1:])[0].items()}
    extra = next(json.loads(raw) for w in shell if (raw := md.option_value(w, "--kv-transfer-config")))
    configs = [
        load_config({}, {"LMCACHE_CONFIG_FILE": str(yaml_file)}),
        load_config({}, env),
        load_config(extra["kv_connector_extra_config"], {}),
    ]
    assert configs[0].summary() != {}
    assert configs[0] == configs[1] == configs[2]


def test_shell_commands_name_what_exists_and_their_flags_are_accepted():
    helps: dict[tuple[str, ...], str] = {}
    for block, words in shell_commands():
        _, words = md.env_prefix(words)
        check_command(block.where, words, helps)


def test_commands_in_prose_name_what_exists():
    helps: dict[tuple[str, ...], str] = {}
    for page in md.pages():
        for span in md.inline_code(md.prose(page)):
            _, words = md.env_prefix(span.split())
            if len(words) > 1 and words[0].endswith(".py") and words[1].startswith("--"):
                words = ["python", *words]  # `bench/lookup.py --compare REF`
            if words and words[0] in ("bash", "python", "streamlit"):
                check_command(f"{page.name}: `{span}`", words, helps)


def check_command(where: str, words: list[str], helps: dict[tuple[str, ...], str]) -> None:
    program, args = words[0], words[1:]
    if program == "bash":
        assert (md.REPO / args[0]).is_file(), f"{where}: no {args[0]}"
        for path in (a for a in args[1:] if "/" in a and not a.startswith("-")):
            assert (md.REPO / path.split("::")[0]).exists(), f"{where}: no {path}"
        if args[0] == "scripts/redis.sh" and len(args) > 1:
            assert f"{args[1]})" in (md.REPO / args[0]).read_text(), f"{where}: redis.sh has no {args[1]}"
    elif program == "python":
        run = ["-m", args[1]] if args[0] == "-m" else [args[0]]
        rest = args[2:] if args[0] == "-m" else args[1:]
        if args[0] == "-m":
            assert module_exists(args[1]), f"{where}: no module {args[1]}"
        else:
            assert (md.REPO / args[0]).is_file(), f"{where}: no {args[0]}"
        if args[0] == "-m" and args[1] in SLOW_HELP:
            return
        usage = help_text(tuple(run), helps)
        for flag in (a.split("=")[0] for a in rest if a.startswith("--")):
            assert flag in usage, f"{where}: {' '.join(run)} has no {flag}"
    elif program == "streamlit":
        assert args[:2] == ["run", "dashboard/app.py"], where
        from dashboard import settings

        flags = args[3:] if args[2:3] == ["--"] else []
        settings.parse(flags, {})
        known = (md.REPO / "dashboard" / "settings.py").read_text()  # parse() ignores unknown flags
        for flag in (a for a in flags if a.startswith("--")):
            assert f'"{flag}"' in known, f"{where}: the app has no {flag}"
    elif program == "docker":
        assert (md.REPO / md.option_value(args, "-f")).is_file(), where
    elif program == "promtool":
        assert (md.REPO / args[-1]).is_file(), where
        out = subprocess.run(["promtool", *args], cwd=md.REPO, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"{where}: {out.stdout}{out.stderr}"
    elif program == "curl" and md.option_value(args, "-d"):
        body = json.loads(md.option_value(args, "-d"))
        tag_keys = page_tag_keys(md.REPO / where.split(":")[0])
        unknown = [
            k for k in body.get("kv_transfer_params", {}) if not known_request_param(k) and k not in tag_keys
        ]
        assert not unknown, f"{where}: KVLens ignores {unknown}"
    elif program == "kvlens":
        sub = [a for a in args if not a.startswith("-")][:1]
        usage = help_text(("-m", "connector.ops.cli", *sub), helps)
        for flag in (a.split("=")[0] for a in args if a.startswith("--")):
            assert flag in usage, f"{where}: kvlens {' '.join(sub)} has no {flag}"
    elif program == "kvlens-vllm":
        scripts = (md.REPO / "pyproject.toml").read_text()
        assert 'kvlens-vllm = "connector.launcher:main"' in scripts, where
    else:
        assert program in EXTERNAL, f"{where}: the docs tests do not know the command {program!r}"


def page_tag_keys(page) -> set[str]:
    """The extra_config.tag_keys a page's YAML examples configure (request keys that become tags)."""
    import yaml

    keys: set[str] = set()
    for b in md.blocks(page):
        if b.lang == "yaml" and "invalid" not in b.tags:
            data = yaml.safe_load(b.text) or {}
            keys.update((data.get("extra_config") or {}).get("tag_keys") or ())
    return keys


def known_request_param(name: str) -> bool:
    from connector.engine.policy import _KNOWN_PARAMS, _TAG_PREFIX

    return name in _KNOWN_PARAMS or name.startswith(_TAG_PREFIX)


def module_exists(name: str) -> bool:
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({name!r}) is None)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=md.REPO,
        capture_output=True,
    )
    return out.returncode == 0


def help_text(run: tuple[str, ...], cache: dict[tuple[str, ...], str]) -> str:
    if run not in cache:
        out = subprocess.run(
            [sys.executable, *run, "--help"], cwd=md.REPO, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, f"{' '.join(run)} --help: {out.stderr[-2000:]}"
        cache[run] = out.stdout
    return cache[run]


def test_promql_blocks_parse(tmp_path):
    from tests.dashboard.promql import promtool_parse

    exprs = []
    for b in of("promql"):
        for line in b.text.splitlines():
            expr = line.split("#")[0].strip()
            if expr:
                exprs.append(expr)
    assert exprs
    out = promtool_parse(exprs, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
