"""Secrets never leave the process: the one redaction layer every way out goes through.

Two kinds of secret are replaced by `[REDACTED]`:

* the values registered with `register_secret` (the configured API key: `HttpChatModel`
  registers it when it is built, so a key echoed back by a server is caught byte for byte);
* anything that looks like a credential whoever configured it: `Bearer <token>`,
  `Authorization: <value>`, OpenAI-style `sk-…` keys, and the password of a
  `scheme://user:password@host` URL or a libpq `password=…` keyword.

`redact` takes text, `redact_data` any JSON-like value (dicts, lists, strings; keys stay as
they are). Both are pure functions of their input and the registry, cheap on text that holds
no secret (one regex scan), and idempotent. Their work is linear in the size of the text,
whatever it holds: no pattern starts where a match could not begin or scans back over what an
earlier attempt scanned, so a model's reply of megabytes (letters and digits without a break,
say) is redacted in milliseconds, not minutes.

Text that no encoder takes (a lone UTF-16 surrogate such as "\ud800", which a model's JSON
escape or a tool's output can hold) leaves as U+FFFD instead: a store, a terminal or a log file
would refuse it, and with it the event that carried it.

The ways out that call it: the model client's errors (at the source), the run recorder (every
event before it is stored), the CLI's stdout/stderr and log handler, exports and diagrams.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from typing import Any
from urllib.parse import unquote

__all__ = [
    "REDACTED",
    "REPLACEMENT",
    "Redacted",
    "SharedData",
    "StreamRedactor",
    "encodable",
    "find_lone_surrogate",
    "redact",
    "redact_data",
    "register_secret",
    "register_url_password",
    "registered_secrets",
]

REDACTED = "[REDACTED]"

_MIN_SECRET_LENGTH = 6
"""Shorter registered values are ignored: redacting "abc" everywhere would garble output and
such a value is not a real credential anyway."""

_PATTERNS = re.compile(
    r"(?P<bearer>(?i:bearer)\s+)[A-Za-z0-9._~+/=-]{6,}"
    r"|(?P<auth>(?i:authorization)\"?\s*[:=]\s*\"?(?:[A-Za-z]+\s+)?)[^\s\"',;]{6,}"
    r"|(?P<sk>\bsk-)[A-Za-z0-9_-]{12,}"
    # A URL's password: matched from the `://` on, whatever scheme precedes it (a scheme matched
    # too would make every letter of a long word a start that scans to the word's end).
    r"|(?P<url>://[^\s:/@]*:)[^\s@/]+(?=@)"
    r"|(?P<kw>\bpassword\s*=\s*)(?:'[^']*'|\"[^\"]*\"|[^\s'\"]+)"
)

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
"""A UTF-16 surrogate code point: in a str, always a lone one (JSON's escaped pairs decode to
the character they encode), which UTF-8 cannot encode."""
REPLACEMENT = "\ufffd"

_lock = threading.Lock()
_secrets: tuple[str, ...] = ()
_secret_pattern: re.Pattern[str] | None = None


def register_secret(value: str | None) -> None:
    """Redact `value` wherever it appears from now on (for the life of the process)."""
    global _secrets, _secret_pattern
    if not value or len(value) < _MIN_SECRET_LENGTH:
        return
    with _lock:
        if value in _secrets:
            return
        # Longest first, so a key that contains another registered key is replaced whole.
        _secrets = tuple(sorted((*_secrets, value), key=len, reverse=True))
        _secret_pattern = re.compile("|".join(re.escape(s) for s in _secrets))
        _registry_changed()


def register_url_password(url: str) -> None:
    """Register the password of a `scheme://user:password@host/...` URL, as written and
    percent-decoded. The userinfo ends at the LAST `@`, as URL parsers read it, so a password
    holding an unencoded `@` is registered whole."""
    netloc = url.partition("://")[2].partition("/")[0]
    userinfo, at, _host = netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return
    password = userinfo.partition(":")[2]
    # Parsers that split at the FIRST `@` quote the rest of the password as the host.
    for secret in (password, unquote(password), *password.split("@")):
        register_secret(secret)


def registered_secrets() -> tuple[str, ...]:
    """The values registered so far (for tests)."""
    return _secrets


def _forget_secrets() -> None:
    """Drop every registered value (tests only)."""
    global _secrets, _secret_pattern
    with _lock:
        _secrets = ()
        _secret_pattern = None
        _registry_changed()


def _replace(match: re.Match[str]) -> str:
    for group in ("bearer", "auth", "sk", "url", "kw"):
        prefix = match.group(group)
        if prefix is not None:
            return prefix + REDACTED
    return REDACTED  # pragma: no cover - every alternative has a named prefix group


def redact(text: str) -> str:
    """`text` with every registered secret and credential-looking token replaced (and any lone
    surrogate, see `encodable`)."""
    text = encodable(text)
    pattern = _secret_pattern
    if pattern is not None and pattern.search(text):
        text = pattern.sub(REDACTED, text)
    if _PATTERNS.search(text):
        text = _PATTERNS.sub(_replace, text)
    return text


def encodable(text: str) -> str:
    """`text` with each lone surrogate replaced by U+FFFD, so that it encodes as UTF-8; the same
    object when it holds none (ASCII text is known to at once)."""
    if text.isascii() or _LONE_SURROGATE.search(text) is None:
        return text
    return _LONE_SURROGATE.sub(REPLACEMENT, text)


def find_lone_surrogate(text: str) -> int:
    """The index of the first lone surrogate in `text` (see `encodable`), or -1."""
    found = None if text.isascii() else _LONE_SURROGATE.search(text)
    return -1 if found is None else found.start()


_LEAVES = frozenset({int, float, bool, type(None)})
"""Exact types that hold no text: returned before any isinstance check (most of an event's
values; the run recorder redacts every event)."""


_SPANS_WORDS = re.compile(r"(?i:bearer|authorization|password)")
"""Where a credential shape may begin that goes on past a space (`Bearer TOKEN`,
`Authorization: Basic X`, `password = 'two words'`): the shapes without a space need no care."""
_HOLD_MAX = 4096
"""The most text kept back: past it, a piece is released at its last space whatever it holds
(no credential shape runs that long, and the work per piece stays bounded)."""


class StreamRedactor:
    """Redacts text that arrives in pieces (a model's streamed answer) as if it came whole.

    `feed` keeps back what could still become part of a secret and returns the rest, redacted:
    the last word (a key may be split between pieces), and from a word holding `bearer`,
    `authorization` or `password` on until a line break after what follows it (the shapes that
    go on past a space), and the start of a registered secret that holds a space. `close`
    returns what is left. Each piece released ends where no shape can span, so redacting the
    pieces one by one redacts what redacting the whole text would.
    """

    def __init__(self) -> None:
        self.held = ""

    def feed(self, text: str) -> str:
        self.held += text
        cut = _release_point(self.held)
        out, self.held = self.held[:cut], self.held[cut:]
        return redact(out) if out else ""

    def close(self) -> str:
        out, self.held = self.held, ""
        return redact(out) if out else ""


def _release_point(text: str) -> int:
    """How much of `text` can be released: up to its last space, never into an open shape."""
    cut = max(text.rfind(space) for space in " \n\t\r") + 1
    if len(text) > _HOLD_MAX:
        return cut
    for found in _SPANS_WORDS.finditer(text, 0, cut):
        if not _closed(text, found.end()):
            start = text.rfind(" ", 0, found.start()) + 1
            cut = min(cut, max(start, text.rfind("\n", 0, found.start()) + 1))
            break
    for secret in _secrets:
        if any(c.isspace() for c in secret):
            cut = _straddled(text, secret, cut)
    return cut


def _closed(text: str, after: int) -> bool:
    """Whether a line break follows `after` with something other than space before it."""
    rest = text[after:]
    seen = False
    for char in rest:
        if char == "\n" and seen:
            return True
        seen = seen or not char.isspace()
    return False


def _straddled(text: str, secret: str, cut: int) -> int:
    """Where `secret`, or a beginning of it that `text` ends with, starts if it would be cut at
    `cut`; else `cut`."""
    for start in range(max(0, cut - len(secret) + 1), cut):
        if secret.startswith(text[start : start + len(secret)]):
            return start
    return cut


def redact_data(value: Any) -> Any:
    """A copy of a JSON-like value with every string redacted; the input is not changed.
    Values that hold no secret are returned as they are (no copy).

    The run recorder calls it on every event, so the common exact types (str, dict, list and
    the leaves) are told apart by `type(...) is` first, and a container's leaves are skipped
    without a call each; subclasses (a FrozenDict, a str enum) take the isinstance path."""
    kind = type(value)
    if kind is str:
        return _redact_str(value)
    if kind is dict:
        return _redact_dict(value)
    if kind is list:
        return _redact_items(value)
    if kind in _LEAVES:
        return value
    if isinstance(value, str):
        return _redact_str(value)
    if isinstance(value, dict):
        return _redact_dict(value)
    if isinstance(value, list | tuple):
        return _redact_items(value)
    return value


def _redact_str(text: str) -> str:
    # Shorter text can hold neither a registered secret nor a credential-looking token
    # (the shortest, `://:p@`, is 6 characters): ids, names and numbers skip the scans.
    if len(text) < _MIN_SECRET_LENGTH:
        return text if text.isascii() else encodable(text)
    clean = _clean
    if clean.holds(text):
        return text
    redacted = redact(text)
    if redacted is text:
        clean.remember(text)
    return redacted


def _redact_dict(value: dict[Any, Any]) -> dict[Any, Any]:
    changed: dict[Any, Any] | None = None  # copied at the first value that changes
    for key, item in value.items():
        if type(item) in _LEAVES:
            continue
        redacted = redact_data(item)
        if redacted is not item:
            if changed is None:
                changed = dict(value)
            changed[key] = redacted
    return value if changed is None else changed


def _redact_items(value: list[Any] | tuple[Any, ...]) -> Any:
    items: list[Any] | None = None  # copied at the first item that changes
    for i, item in enumerate(value):
        if type(item) in _LEAVES:
            continue
        redacted = redact_data(item)
        if redacted is not item:
            if items is None:
                items = list(value)
            items[i] = redacted
    if items is None:
        return value
    return tuple(items) if isinstance(value, tuple) else items


_CLEAN_MAX_LENGTH = 256
"""Text up to this long is remembered by its value (a lookup hashes short text at most);
longer text by the object only (the workflow's text, a system prompt: the same object in
every run's `run.started`), so a long text is never hashed to be looked up."""
_CLEAN_MAX_COUNT = 4096
"""Short texts remembered at most: past it the set starts over (memory stays bounded)."""
_CLEAN_MAX_LONG = 64
"""Long texts remembered at most (by object): past it they start over."""


class _CleanTexts:
    """Texts `redact` returned unchanged under the registry as it is now: state names, guard
    labels, tool names and ids, which an event repeats at every step, and the long texts every
    run records again (the workflow's text). Redaction is a pure function of the text and the
    registry, so a text found here needs no scan; registering a secret replaces this with an
    empty one (see `_registry_changed`)."""

    __slots__ = ("long", "texts")

    def __init__(self) -> None:
        self.texts: set[str] = set()
        self.long: dict[int, str] = {}
        """id(text) → text (held, so that its id is not reused while it is here)."""

    def holds(self, text: str) -> bool:
        if len(text) <= _CLEAN_MAX_LENGTH:
            return text in self.texts
        return self.long.get(id(text)) is text

    def remember(self, text: str) -> None:
        if len(text) <= _CLEAN_MAX_LENGTH:
            if len(self.texts) >= _CLEAN_MAX_COUNT:
                self.texts = set()
            self.texts.add(text)
            return
        if len(self.long) >= _CLEAN_MAX_LONG:
            self.long = {}
        self.long[id(text)] = text


_clean = _CleanTexts()
_generation = 0
"""Bumped whenever the registry changes: what was redacted before may need it again."""


def _registry_changed() -> None:
    """A secret was registered or forgotten (called with `_lock` held): what was clean
    before may not be now."""
    global _clean, _generation
    _clean = _CleanTexts()
    _generation += 1


class Redacted:
    """A JSON-like value that is recorded again and again unchanged (the data of a transition
    the engine decided before), redacted once and reused until a secret is registered.

    `get()` is `redact_data(value)`, computed again only when the registry changed since it
    was last computed. The run recorder takes one in place of the data it would redact: the
    value must not be changed once wrapped (the recorder shares it between events)."""

    __slots__ = ("_generation", "_redacted", "value")

    def __init__(self, value: Any) -> None:
        self.value = value
        self._redacted: Any = None
        self._generation = -1

    def get(self) -> Any:
        generation = _generation  # read first: a secret registered meanwhile redoes it
        if self._generation != generation:
            redacted = redact_data(self.value)
            self._redacted = SharedData(redacted) if type(redacted) is dict else redacted
            self._generation = generation
        return self._redacted


class SharedData(dict[str, Any]):
    """The data of events that share it (a `Redacted`'s value): a dict that never changes, so
    a store encodes it once (`encoded`, filled in by the first store that encodes it) rather
    than at every event that holds it."""

    __slots__ = ("encoded",)

    def __init__(self, value: dict[str, Any]) -> None:
        super().__init__(value)
        self.encoded: str | None = None


def redact_lines(lines: Iterable[str]) -> Iterable[str]:
    """Each line redacted (for streamed exports)."""
    for line in lines:
        yield redact(line)
