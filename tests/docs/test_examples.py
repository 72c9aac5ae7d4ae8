"""Every example in the docs runs: the docs cannot say what the program does not do.

Each Markdown page under docs/ (and README.md, CONTRIBUTING.md) is one test that runs its code
blocks in order, in a fresh folder of its own, against the fake OpenAI-compatible server
(tests/fakes/openai_server.py) with the replies the page's directives script (see
tests/docs/_blocks.py):

- `console` blocks: each `$ command` runs in bash on a pseudo-terminal (as a reader's terminal
  shows it: progress and answer in the order they appear) and its output must match the lines
  shown under it, after ids, times and durations are masked; a line `...` stands for any lines.
  FSM_KERNEL_DOCS_REGEN=1 writes the actual output into the page instead (review the diff).
- `sh`/`bash` blocks run in bash and must exit 0 (CONTRIBUTING.md's only have their commands
  checked: they install packages and run the checks themselves).
- `python` blocks run in a Python process of their own and must exit 0.
- `yaml` blocks must parse; one that is a whole workflow must pass `fsm-kernel validate`.
- Every `fsm-kernel ...` line in any block is parsed by the real argument parser, so a renamed
  or removed flag fails here even where the block does not run.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.docs._blocks import Block, blocks
from tests.fakes.openai_server import FakeOpenAIServer, reply_from_spec

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [*(ROOT / "docs").rglob("*.md"), ROOT / "README.md", ROOT / "CONTRIBUTING.md"],
    key=lambda p: str(p.relative_to(ROOT)),
)
REGEN = os.environ.get("FSM_KERNEL_DOCS_REGEN") == "1"
TIMEOUT = 60.0
SHELLS = {"sh", "bash", "shell"}
DEFAULT_REPLIES = ["Done."] * 40
"""What the fake model answers a Python block that scripts nothing."""

UUID = re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b")
MASKS = [
    (UUID, "<id>"),
    (re.compile(r"(?<![0-9A-Za-z])[0-9a-f]{8,}(?![0-9A-Za-z])"), "<id>"),  # prefixes, call_…
    (re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d(:\d\d(\.\d+)?)?([+-]\d\d:\d\d|Z)?"), "<time>"),
    (re.compile(r"\((Mon|Tues|Wednes|Thurs|Fri|Satur|Sun)day\)"), "(<day>)"),
    (re.compile(r"\b\d+(\.\d+)?\s?(ms|s)\b"), "<duration>"),
    (re.compile(r"127\.0\.0\.1:\d+"), "127.0.0.1:<port>"),
    (re.compile(r"[ \t]+"), " "),
]


def normalise(text: str) -> list[str]:
    """Output lines with what changes from run to run masked, blank lines at the ends cut."""
    lines = []
    for line in text.replace("\r", "").split("\n"):
        for pattern, mask in MASKS:
            line = pattern.sub(mask, line)
        lines.append(line.strip())
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return lines


def matches(expected: list[str], actual: list[str]) -> bool:
    """`expected` equals `actual`, a line `...` standing for any number of lines."""
    if not expected:
        return not actual
    if expected[0] == "...":
        return any(matches(expected[1:], actual[i:]) for i in range(len(actual) + 1))
    return bool(actual) and expected[0] == actual[0] and matches(expected[1:], actual[1:])


def run_on_terminal(command: str, cwd: Path, env: dict[str, str]) -> str:
    """What `command` prints on a terminal (stdout and stderr, in order)."""
    master, slave = pty.openpty()
    process = subprocess.Popen(
        ["bash", "-c", command], stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env
    )
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + TIMEOUT
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # the terminal closed: everything was read
                    break
                if not data:
                    break
                chunks.append(data)
            elif process.poll() is not None:
                break
        else:
            process.kill()
            pytest.fail(f"`{command}` did not end within {TIMEOUT:.0f} s")
    finally:
        os.close(master)
        process.wait(timeout=10)
    return b"".join(chunks).decode("utf-8", "replace")


class Page:
    """One page's run: its folder, its fake model server, the run ids it has seen."""

    def __init__(self, path: Path, folder: Path, server: FakeOpenAIServer) -> None:
        self.path, self.folder, self.server = path, folder, server
        self.commands_only = path.name == "CONTRIBUTING.md"
        self.ids: dict[str, str] = {}
        """A run id the page shows → the id of the run this test made in its place."""
        self.edits: list[tuple[Block, list[str]]] = []
        self.last_stdout = ""
        bin_dir = folder / ".bin"
        bin_dir.mkdir()
        wrapper = bin_dir / "fsm-kernel"
        wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m fsm_kernel "$@"\n')
        wrapper.chmod(0o755)
        self.env = {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": os.pathsep.join(
                [str(ROOT), str(folder), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            "FSM_KERNEL_BASE_URL": server.base_url,
            "FSM_KERNEL_MODEL": "demo",
            "FSM_KERNEL_MAX_RETRIES": "0",
            "TZ": "UTC",
            "USER": "you",
            "COLUMNS": "100",
            "TERM": "dumb",
        }
        for name in ("FSM_KERNEL_STORE", "FSM_KERNEL_API_KEY", "OPENAI_API_KEY"):
            self.env.pop(name, None)

    # -- one block -------------------------------------------------------------------------

    def run(self, block: Block) -> None:
        if "skip" in block.directives:
            return
        self.prepare(block)
        if block.lang in ("yaml", "yml"):
            self.yaml(block)
        elif block.lang in ("python", "py") and "file" not in block.directives:
            self.python(block)
        elif block.lang == "console":
            self.console(block)
        elif block.lang in SHELLS and not self.commands_only:
            self.shell(block)
        elif "output" in block.directives:
            expected = normalise(block.text)
            assert matches(expected, normalise(self.last_stdout)), (
                f"{self.path.name} {block.where}: the Python block above printed\n"
                f"{self.last_stdout}\nnot what the page shows"
            )

    def prepare(self, block: Block) -> None:
        """The block's replies on the fake server, its file in the folder."""
        d = block.directives
        runs_python = block.lang in ("python", "py") and "file" not in d
        if "replies" in d or runs_python:
            self.forget_replies()
        if "replies" in d:
            self.server.enqueue(*(reply_from_spec(r) for r in json.loads(d["replies"])))
        elif runs_python:
            self.server.enqueue(*(reply_from_spec(r) for r in DEFAULT_REPLIES))
        if "file" in d:
            target = self.folder / d["file"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.text, encoding="utf-8")

    def yaml(self, block: Block) -> None:
        try:
            data = yaml.safe_load(block.text)
        except yaml.YAMLError as exc:
            pytest.fail(f"{self.path.name} {block.where}: not YAML: {exc}")
        whole = (
            isinstance(data, dict) and {"name", "states", "transitions", "initial"} <= data.keys()
        )
        if not whole or "fragment" in block.directives:
            return
        path = self.folder / block.directives.get("file", f"_block_{block.line}.yaml")
        if not path.exists():
            path.write_text(block.text, encoding="utf-8")
        done = subprocess.run(
            ["fsm-kernel", "validate", str(path)],
            capture_output=True,
            text=True,
            cwd=self.folder,
            env=self.env,
            timeout=TIMEOUT,
        )
        if "invalid" in block.directives:  # an example of a mistake: validate must refuse it
            assert done.returncode == 2, f"{self.path.name} {block.where}: validate took it"
            return
        assert done.returncode == 0, f"{self.path.name} {block.where}: {done.stderr}"

    def python(self, block: Block) -> None:
        script = self.folder / f"_block_{block.line}.py"
        script.write_text(block.text, encoding="utf-8")
        done = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            cwd=self.folder,
            env=self.env,
            timeout=TIMEOUT,
        )
        self.last_stdout = done.stdout
        assert done.returncode == 0, (
            f"{self.path.name} {block.where}: the example failed:\n{done.stdout}{done.stderr}"
        )

    def shell(self, block: Block) -> None:
        done = subprocess.run(
            ["bash", "-e", "-c", block.text],
            capture_output=True,
            text=True,
            cwd=self.folder,
            env=self.env,
            timeout=TIMEOUT,
            stdin=subprocess.DEVNULL,
        )
        assert done.returncode == 0, (
            f"{self.path.name} {block.where}: exit {done.returncode}\n{done.stdout}{done.stderr}"
        )

    def console(self, block: Block) -> None:
        shown: list[str] = []
        for command, expected in console_steps(block.text):
            command = self.with_ids(command)
            actual = run_on_terminal(command, self.folder, self.env)
            self.learn_ids(expected, actual)
            got = [line.rstrip() for line in actual.replace("\r", "").rstrip("\n").split("\n")]
            shown += [f"$ {command}", *([] if got == [""] else got)]
            if not REGEN:
                assert matches(normalise("\n".join(expected)), normalise(actual)), (
                    f"{self.path.name} {block.where}: `{command}` printed\n{actual}\n"
                    "not what the page shows (FSM_KERNEL_DOCS_REGEN=1 writes it in)"
                )
        if REGEN and "keep" not in block.directives:
            self.edits.append((block, shown))

    def forget_replies(self) -> None:
        """Drop the replies an earlier block left unused: each block gets its own script."""
        with self.server._lock:  # the fake server has no public way to empty its queue
            self.server._queue.clear()

    # -- run ids ---------------------------------------------------------------------------

    def learn_ids(self, expected: list[str], actual: str) -> None:
        shown = UUID.findall("\n".join(expected))
        made = UUID.findall(actual)
        for old, new in zip(shown, made, strict=False):
            self.ids.setdefault(old, new)

    def with_ids(self, command: str) -> str:
        """`command` with each prefix of a run id the page showed replaced by the real id."""

        def swap(match: re.Match[str]) -> str:
            token = match.group(0)
            for old, new in self.ids.items():
                if old.startswith(token):
                    return new[: len(token)]
            return token

        return re.sub(r"\b[0-9a-f]{6,}[0-9a-f-]*\b", swap, command)

    # -- regeneration ----------------------------------------------------------------------

    def write_edits(self) -> None:
        lines = self.path.read_text(encoding="utf-8").split("\n")
        for block, shown in sorted(self.edits, key=lambda e: -e[0].line):
            body = [f"{block.indent}{line}".rstrip() for line in shown]
            lines[block.line : block.end_line - 1] = body
        self.path.write_text("\n".join(lines), encoding="utf-8")


def console_steps(text: str) -> Iterator[tuple[str, list[str]]]:
    """Each `$ command` of a console block (continued over lines ending in `\\`) and the
    lines shown under it."""
    command: str | None = None
    output: list[str] = []
    lines = iter(text.rstrip("\n").split("\n"))
    for line in lines:
        if line.startswith("$ "):
            if command is not None:
                yield command, output
            command, output = line[2:], []
            while command.endswith("\\"):
                command = command[:-1] + next(lines, "")
        elif command is not None:
            output.append(line)
    if command is not None:
        yield command, output


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(strict=False) as fake:
        yield fake


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_examples_run(path: Path, tmp_path: Path, server: FakeOpenAIServer) -> None:
    page = Page(path, tmp_path, server)
    for block in blocks(path):
        page.run(block)
    if REGEN and page.edits:
        page.write_edits()


# --- every documented command line parses -------------------------------------------------


def command_lines(block: Block) -> Iterator[list[str]]:
    """The arguments of every `fsm-kernel` command in the block (up to a `;`, `|`, `&&` or a
    redirection)."""
    text = re.sub(r"\\\n", " ", block.text)
    for line in text.splitlines():
        line = line.strip().removeprefix("$ ")
        if "fsm-kernel" not in line.split("#")[0]:
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        try:
            words = list(lexer)
        except ValueError:
            continue
        while words and "=" in words[0] and words[0] != "fsm-kernel":
            words.pop(0)  # NAME=value before the command
        if not words or words[0] != "fsm-kernel":
            continue
        args: list[str] = []
        for word in words[1:]:
            if set(word) <= set("();<>|&"):
                if args and args[-1].isdigit() and word.startswith(">"):
                    args.pop()  # the 2 of 2>&1
                break
            args.append(word.strip("[]"))
        yield [a for a in args if a]


_DOC_ERRORS = ("unrecognized arguments", "invalid choice", "required", "expected one argument")


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_documented_commands_parse(path: Path) -> None:
    from fsm_kernel.cli import UsageError, build_parser

    wrong = []
    for block in blocks(path):
        if block.lang not in (*SHELLS, "console", "text", ""):
            continue
        for args in command_lines(block):
            if "--help" in args or (args and args[0] in ("--version", "-h")):
                continue
            try:
                build_parser().parse_args(args)
            except UsageError as exc:
                if any(marker in str(exc) for marker in _DOC_ERRORS):
                    wrong.append(f"{block.where}: fsm-kernel {' '.join(args)}: {exc}")
            except SystemExit:  # argparse's own exits (none expected: errors raise)
                wrong.append(f"{block.where}: fsm-kernel {' '.join(args)}: exited")
    assert not wrong, f"{path.name}: commands the CLI refuses:\n" + "\n".join(wrong)
