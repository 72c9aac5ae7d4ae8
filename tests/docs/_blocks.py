"""The code blocks of a Markdown page, with the test directives written above them.

A directive is an HTML comment on the lines right above a fence (invisible on the site):

    <!-- test: skip=why -->          do not run this block (a server, `pip install`, ...)
    <!-- test: file=NAME -->         write the block into the page's folder as NAME first
    <!-- test: replies=[...] -->     the fake model server's next replies (JSON, script mode)
    <!-- test: fragment -->          YAML that is part of a workflow: parsed, not validated
    <!-- test: invalid -->           a workflow with a mistake: `validate` must refuse it
    <!-- test: output -->            a text block: the stdout of the Python block above it
    <!-- test: keep -->              a console block FSM_KERNEL_DOCS_REGEN=1 leaves as it is

Several comments may be stacked; a comment may span lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
DIRECTIVE = re.compile(r"<!--\s*test:(?P<body>.*?)-->", re.S)


@dataclass
class Block:
    """One fenced code block: its language, text, line (1-based) and directives."""

    lang: str
    text: str
    line: int
    end_line: int
    indent: str
    directives: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"line {self.line}"


def _directives(before: list[str]) -> dict[str, str]:
    """The directives in the comments that end right above a fence."""
    text = ""
    for line in reversed(before):
        if not line.strip():
            break
        text = line + "\n" + text
    found: dict[str, str] = {}
    for match in DIRECTIVE.finditer(text):
        key, _, value = match.group("body").strip().partition("=")
        found[key.strip()] = value.strip()
    return found


def blocks(path: Path) -> list[Block]:
    """Every fenced code block of the page, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence = match.group("indent"), match.group("fence")
        info = match.group("info").strip()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        found.append(
            Block(
                lang=info.split()[0].lower() if info else "",
                text="\n".join(body) + "\n",
                line=start + 1,
                end_line=i + 1,
                indent=indent,
                directives=_directives(lines[max(0, start - 12) : start]),
            )
        )
        i += 1
    return found
