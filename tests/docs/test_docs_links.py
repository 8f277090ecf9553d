"""The README is a short front door whose links, and every docs page's links, paths and named
functions, lead somewhere that exists."""

from __future__ import annotations

import importlib
import re

import pytest

from . import markdown as md

README_LIMIT = 12 * 1024
# Inline code that names a file of this repository: `bench/soak.py`, `grafana/compose.yaml`, ...
REPO_PATH = re.compile(r"^(?:bench|connector|dashboard|docs|grafana|scripts|telemetry|tests)/[\w./-]*$")
# Inline code that names a function of ours: `telemetry.events.read_events(path)`.
PYTHON_NAME = re.compile(r"^((?:connector|dashboard|grafana|telemetry)(?:\.\w+)+)\(")


def test_readme_fits_on_a_screen_or_two():
    assert md.README.stat().st_size < README_LIMIT


def test_readme_starts_with_the_two_quick_start_commands():
    first = md.blocks(md.README)[0]
    shown = [" ".join(words) for words in md.commands(first)]
    assert shown == ["bash scripts/demo.sh", "bash scripts/test.sh"]


def test_every_docs_page_is_linked_from_the_readme():
    linked = {target.split("#")[0] for target in md.links(md.README)}
    assert {f"docs/{p.name}" for p in md.DOCS.glob("*.md")} <= linked


@pytest.mark.parametrize("page", sorted(md.DOCS.glob("*.md")), ids=lambda p: p.name)
def test_each_docs_page_opens_with_what_it_answers(page):
    lines = page.read_text().splitlines()
    assert lines[0].startswith("# ") and lines[1] == ""
    intro = lines[2]
    assert intro and not intro.startswith(("#", "-", "|", "`", "!")), "a sentence or two, first"


@pytest.mark.parametrize("page", md.pages(), ids=lambda p: p.name)
def test_relative_links_and_anchors_resolve(page):
    broken = []
    for target in md.links(page):
        if re.match(r"^[a-z]+://|^mailto:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in md.anchors(path):
            broken.append(target)
    assert not broken


@pytest.mark.parametrize("page", md.pages(), ids=lambda p: p.name)
def test_repository_paths_in_the_text_exist(page):
    missing = [
        span
        for span in md.inline_code(md.prose(page))
        if REPO_PATH.match(span.split()[0]) and not (md.REPO / span.split()[0]).exists()
    ]
    assert not missing


@pytest.mark.parametrize("page", md.pages(), ids=lambda p: p.name)
def test_functions_named_in_the_text_exist(page):
    for span in md.inline_code(md.prose(page)):
        m = PYTHON_NAME.match(span)
        if m:
            module, _, name = m.group(1).rpartition(".")
            assert hasattr(importlib.import_module(module), name), span
