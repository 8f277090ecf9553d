"""Reading the project's Markdown the way the docs tests need it: fenced blocks with their info
strings, links, heading anchors, inline code and the shell commands a block shows."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


@dataclass(frozen=True, slots=True)
class Block:
    """One fenced code block: ```lang tag tag=value ... on its opening line."""

    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    tags: dict[str, str]  # words after the language; "invalid" -> {"invalid": ""}
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


_FENCE = re.compile(r"^```(.*)$")


def blocks(path: Path) -> list[Block]:
    out: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        words = m.group(1).split()
        start, body = i, []
        i += 1
        while i < len(lines) and lines[i] != "```":
            body.append(lines[i])
            i += 1
        tags = dict(w.partition("=")[::2] for w in words[1:])
        out.append(Block(path, start + 1, words[0] if words else "", tags, "\n".join(body) + "\n"))
        i += 1
    return out


def all_blocks() -> list[Block]:
    return [b for p in pages() for b in blocks(p)]


def prose(path: Path) -> str:
    """The page without its fenced blocks (links and inline code inside them are not prose)."""
    return re.sub(r"^```.*?^```$", "", path.read_text(), flags=re.M | re.S)


def inline_code(text: str) -> list[str]:
    return [m.replace("\n", " ") for m in re.findall(r"`([^`]+)`", text)]


def links(path: Path) -> list[str]:
    """Targets of [text](target) and ![alt](target), outside code."""
    text = re.sub(r"`[^`]*`", "", prose(path))
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, punctuation dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = text.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def commands(block: Block) -> Iterator[list[str]]:
    """Each command of a shell block as words: comments dropped, backslash continuations and
    quoted strings that span lines joined, ``&&`` / ``;`` / ``|`` splitting commands."""
    pending = ""
    for line in block.text.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the string goes on on the next line
            continue
        pending = ""
        command: list[str] = []
        for word in words:
            if word in ("&&", "||", ";", "|"):
                if command:
                    yield command
                command = []
            else:
                command.append(word)
        if command:
            yield command
    assert not pending, f"{block.where}: unterminated command {pending!r}"


def env_prefix(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """``A=1 B=2 cmd args`` -> ({"A": "1", "B": "2"}, ["cmd", "args"])."""
    env = {}
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        name, _, value = words[0].partition("=")
        env[name] = value
        words = words[1:]
    return env, words


def option_value(words: list[str], option: str) -> str | None:
    for i, word in enumerate(words):
        if word == option and i + 1 < len(words):
            return words[i + 1]
        if word.startswith(option + "="):
            return word[len(option) + 1 :]
    return None
