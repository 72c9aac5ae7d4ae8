"""Everything the CLI writes goes through `SafeStream`: secrets are redacted, and control
characters from model and tool text cannot drive the terminal.

Control characters (C0 but tab and newline, DEL, C1) are shown as `\\uXXXX`, which is also a
valid JSON escape for the same character: `--json` output, where json.dumps already escapes C0,
stays valid JSON with the exact text. Lone surrogates (bytes that were not UTF-8, e.g. a file
name) become U+FFFD instead of crashing the write.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO, cast

from fsm_kernel.redact import redact

__all__ = ["CUT", "SafeStream", "cut", "printable", "safe_stdio"]

CUT = 200
"""The most characters `cut` keeps by default."""

_CONTROL = {
    code: f"\\u{code:04x}"
    for code in (*range(0x00, 0x20), *range(0x7F, 0xA0))
    if code not in (0x09, 0x0A)
}


def cut(text: str, limit: int = CUT) -> str:
    """One line, at most `limit` characters (here, not in output.py, so that the commands
    that list runs need not import the event types to build their parsers)."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def printable(text: str) -> str:
    """`text` redacted, with control characters escaped and undecodable bytes replaced."""
    text = redact(text.replace("\r\n", "\n").translate(_CONTROL))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    return text


class SafeStream:
    """A text stream that passes every write through `printable`."""

    def __init__(self, inner: TextIO) -> None:
        self.inner = inner

    def write(self, text: str) -> int:
        self.inner.write(printable(text))
        return len(text)

    def flush(self) -> None:
        self.inner.flush()

    def isatty(self) -> bool:
        return self.inner.isatty()

    def fileno(self) -> int:
        return self.inner.fileno()

    def __getattr__(self, name: str) -> Any:  # encoding, buffer, errors, ... of the wrapped one
        return getattr(self.inner, name)


@contextmanager
def safe_stdio() -> Iterator[None]:
    """sys.stdout and sys.stderr wrapped in SafeStream for the duration."""
    import sys

    saved = sys.stdout, sys.stderr
    sys.stdout = cast(TextIO, SafeStream(saved[0]))
    sys.stderr = cast(TextIO, SafeStream(saved[1]))
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
