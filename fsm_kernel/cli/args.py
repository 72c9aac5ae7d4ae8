"""Checks at the CLI boundary: every flag and argument is validated where it is parsed, so bad
input is a usage error (exit 2, one line) and never reaches the kernel as NaN, a negative count
or undecodable text.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

from fsm_kernel.errors import ConfigError

__all__ = [
    "MAX_PROMPT_BYTES",
    "TEXT_ARGUMENTS",
    "check_text_arguments",
    "count",
    "existing_dir",
    "read_prompt",
    "seconds",
]

TEXT_ARGUMENTS = frozenset({"prompt", "system_prompt", "input", "reject"})
"""Free text (a prompt, an answer to a run's question, a reason for a rejection): bytes that
are not UTF-8 are replaced by U+FFFD. Every other string argument (paths, names, URLs) with
such bytes is refused: guessing would name another file."""

MAX_PROMPT_BYTES = 4 * 1024 * 1024
"""The longest prompt taken, from any source: 4 MiB, about a million tokens, the context of
the largest models. At most one byte more is read, so `--prompt-file /dev/zero` or an endless
stdin is refused at once instead of filling the memory."""

SHOWN_CHARS = 60
"""The most of a refused argument an error message repeats."""


def seconds(text: str) -> float:
    """A finite number of seconds >= 0 (0 means no limit where the flag says so)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number of seconds >= 0")
    return value


def count(low: int, high: int) -> Callable[[str], int]:
    """A whole number in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range ({low} to {high:,})")
        return value

    parse.__name__ = "count"  # argparse names the type in its messages
    return parse


def existing_dir(text: str) -> str:
    """A directory that exists."""
    path = Path(text).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such directory")
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: not a directory")
    return str(path)


def _decodable(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _repair(value: str) -> str:
    """argv bytes that are not UTF-8 arrive as lone surrogates; make them U+FFFD."""
    return value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def check_text_arguments(args: argparse.Namespace) -> None:
    """Repair free text and refuse any other argument that is not valid UTF-8.

    Raises:
        ConfigError: a path or name argument holds bytes that are not UTF-8.
    """
    for name, value in vars(args).items():
        if not isinstance(value, str) or _decodable(value):
            continue
        if name in TEXT_ARGUMENTS:
            setattr(args, name, _repair(value))
            continue
        raise ConfigError(
            f"{name.replace('_', '-')} {shown(_repair(value))} is not valid UTF-8 text (rename "
            "it, or run with a UTF-8 locale)"
        )


def shown(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text` quoted for an error message: whole when short, else its start and its size (a
    message that repeats a 100 KB argument hides what it says)."""
    if len(text) <= limit:
        return repr(text)
    size = len(text.encode("utf-8", "surrogateescape"))
    return f"{text[:limit]!r}… ({size:,} bytes)"


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """The task: --prompt TEXT, --prompt - (stdin) or --prompt-file PATH, decoded as UTF-8
    with undecodable bytes replaced; at most MAX_PROMPT_BYTES.

    Raises:
        ConfigError: no prompt, both forms, an unreadable file, a prompt over the limit, or an
            empty prompt.
    """
    if (prompt is None) == (prompt_file is None):
        raise ConfigError(
            "give the task with exactly one of --prompt TEXT, --prompt - (stdin) or "
            "--prompt-file PATH"
        )
    if prompt_file is not None:
        data = _read_file(prompt_file)
        where = f"--prompt-file {prompt_file}"
    elif prompt == "-":
        data = _read_stdin()
        where = "--prompt - (stdin)"
    else:
        assert prompt is not None
        data = prompt.encode("utf-8", "surrogateescape")
        where = "--prompt"
    if len(data) > MAX_PROMPT_BYTES:
        raise ConfigError(
            f"{where}: the prompt is longer than {MAX_PROMPT_BYTES // 1024 // 1024} MiB, the "
            "most a prompt may be"
        )
    text = data.decode("utf-8", "replace")
    if not text.strip():
        raise ConfigError("the prompt is empty")
    return text


def _read_file(path: str) -> bytes:
    """At most MAX_PROMPT_BYTES + 1 bytes of the file (one more tells it is too long)."""
    try:
        with Path(path).expanduser().open("rb") as file:
            return file.read(MAX_PROMPT_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read --prompt-file {path}: {exc.strerror or exc}") from None


def _read_stdin() -> bytes:
    """At most MAX_PROMPT_BYTES + 1 bytes of stdin."""
    buffer = getattr(sys.stdin, "buffer", None)  # absent when a test swaps in a StringIO
    if buffer is None:
        return sys.stdin.read(MAX_PROMPT_BYTES + 1).encode("utf-8", "surrogateescape")
    data: bytes = buffer.read(MAX_PROMPT_BYTES + 1)
    return data
