"""The redaction layer: registered secrets and credential-shaped tokens are replaced wherever
they appear; everything else passes through untouched (the same object, no copy)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from fsm_kernel.redact import (
    REDACTED,
    StreamRedactor,
    _forget_secrets,
    encodable,
    find_lone_surrogate,
    redact,
    redact_data,
    redact_lines,
    register_secret,
    register_url_password,
    registered_secrets,
)


@pytest.fixture(autouse=True)
def _clean_registry() -> Iterator[None]:
    _forget_secrets()
    yield
    _forget_secrets()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Authorization: Bearer abc.def-123_456", "Authorization: Bearer [REDACTED]"),
        ("header bearer  0123456789 end", "header bearer  [REDACTED] end"),
        ('{"authorization": "Basic dXNlcjpwYXNz"}', '{"authorization": "Basic [REDACTED]"}'),
        ("authorization=rawtoken123", "authorization=[REDACTED]"),
        ("key sk-proj-abcdefghijklmnop was rejected", "key sk-[REDACTED] was rejected"),
        ("postgresql://bob:hunter22@db:5432/x", "postgresql://bob:[REDACTED]@db:5432/x"),
        ("host=db password=hunter2 dbname=x", "host=db password=[REDACTED] dbname=x"),
        ("password='two words' user=x", "password=[REDACTED] user=x"),
    ],
)
def test_credential_shapes_are_redacted(text: str, expected: str) -> None:
    assert redact(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "nothing secret here",
        "sk-short",  # too short to be a key
        "the bearer of bad news",  # 'news' is shorter than a token
        "postgresql://db:5432/runs",  # no password
        "https://example.com/a:b@c",  # no userinfo before the path
    ],
)
def test_ordinary_text_is_left_alone(text: str) -> None:
    assert redact(text) is text


def test_a_registered_secret_is_redacted_whatever_its_shape() -> None:
    register_secret("local-key-0123456789")

    assert redact("echo: local-key-0123456789!") == f"echo: {REDACTED}!"


def test_the_longest_registered_secret_wins() -> None:
    register_secret("abcdef123")
    register_secret("abcdef123456789")

    assert redact("x abcdef123456789 y") == f"x {REDACTED} y"
    assert redact("x abcdef123 y") == f"x {REDACTED} y"


def test_a_secret_that_contains_another_is_replaced_whole_whatever_their_order() -> None:
    register_secret("abcdef123")
    register_secret("0abcdef123")  # longer, yet sorts before the shorter one

    assert redact("x 0abcdef123 y") == f"x {REDACTED} y"


def test_short_or_empty_values_are_not_registered() -> None:
    for value in (None, "", "abc", "12345"):
        register_secret(value)
    register_secret("123456")
    register_secret("123456")  # twice: registered once

    assert registered_secrets() == ("123456",)


def test_url_passwords_are_registered_as_written_decoded_and_split_at_at_signs() -> None:
    register_url_password("postgresql://fsm:p%40ss@word-hunter2@db:5432/runs")

    assert set(registered_secrets()) == {
        "p%40ss@word-hunter2",  # as written
        "p@ss@word-hunter2",  # decoded
        "p%40ss",  # the pieces between @ signs, when long enough to be worth hiding
        "word-hunter2",
    }
    # A driver that split the URL at the first @ quotes the rest as a host name.
    assert redact("cannot resolve host 'word-hunter2@db'") == f"cannot resolve host '{REDACTED}@db'"


@pytest.mark.parametrize(
    ("url", "password"),
    [
        ("postgresql://user:pa:ss123456@db/x", "pa:ss123456"),  # the first colon ends the user
        ("postgresql://user:secretpw@db/a@b/c", "secretpw"),  # an @ in the path is no userinfo
        ("postgresql://user:secretpw@db/x?next=http://h/", "secretpw"),  # nor a :// after it
    ],
)
def test_only_the_password_of_the_userinfo_is_registered(url: str, password: str) -> None:
    register_url_password(url)

    assert registered_secrets() == (password,)


@pytest.mark.parametrize(
    "url", ["postgresql://db/runs", "postgresql://user@db/runs", "postgresql://u:@db/x"]
)
def test_urls_without_a_password_register_nothing(url: str) -> None:
    register_url_password(url)

    assert registered_secrets() == ()


def test_redact_data_walks_json_like_values_and_copies_only_what_changes() -> None:
    register_secret("s3cr3t-value")
    clean = {"a": [1, "x"], "b": {"c": None}}
    dirty = {"keep": clean, "list": ["s3cr3t-value", 2], "tuple": ("Bearer abcdefgh",)}

    out = redact_data(dirty)

    assert redact_data(clean) is clean
    assert out == {"keep": clean, "list": [REDACTED, 2], "tuple": ("Bearer [REDACTED]",)}
    assert out["keep"] is clean
    assert dirty["list"] == ["s3cr3t-value", 2]  # the input is not changed


def test_redact_data_scans_strings_as_short_as_the_shortest_secret() -> None:
    register_secret("abc123")  # six characters: the shortest value registered
    assert redact_data({"key": "abc123", "url": "a://:p@h"}) == {
        "key": REDACTED,
        "url": "a://:[REDACTED]@h",
    }
    short = ["abc12", "x"]  # shorter than any secret: returned as they are, unscanned
    assert redact_data(short) is short


def test_text_found_clean_is_scanned_again_once_a_secret_is_registered() -> None:
    # redact_data remembers short text it found clean (state names, labels repeat at every
    # step); a secret registered later must still be caught in that same text.
    long = "workflow text " * 40 + "hunter2-x"  # remembered by the object, not its value
    event = {"state": "think-hunter2-x", "tried": [{"check": "uses hunter2-x"}], "text": long}
    assert redact_data(event) is event
    assert redact_data(event) is event  # answered from what it remembered

    register_secret("hunter2-x")

    assert redact_data(event) == {
        "state": "think-[REDACTED]",
        "tried": [{"check": f"uses {REDACTED}"}],
        "text": "workflow text " * 40 + REDACTED,
    }


def test_what_redaction_remembers_stays_bounded() -> None:
    from fsm_kernel import redact as module

    for i in range(3 * module._CLEAN_MAX_LONG):
        assert redact_data(f"{i:>300}") == f"{i:>300}"
    for i in range(module._CLEAN_MAX_COUNT + 10):
        assert redact_data(f"id-{i:06}") == f"id-{i:06}"

    assert 0 < len(module._clean.long) <= module._CLEAN_MAX_LONG
    assert 0 < len(module._clean.texts) <= module._CLEAN_MAX_COUNT


def test_subclasses_of_str_dict_and_list_are_walked_like_the_plain_types() -> None:
    from fsm_kernel.session import FrozenDict

    register_secret("s3cr3t-value")

    class Text(str):
        pass

    frozen = FrozenDict({"args": ["s3cr3t-value", 1], "n": 2})
    out = redact_data({"frozen": frozen, "text": Text("key s3cr3t-value")})

    assert out == {"frozen": {"args": [REDACTED, 1], "n": 2}, "text": f"key {REDACTED}"}
    assert type(out["frozen"]) is dict  # a changed copy is a plain dict
    assert frozen["args"][0] == "s3cr3t-value"


def test_a_redacted_value_is_redacted_once_and_again_after_a_secret_is_registered() -> None:
    from fsm_kernel.redact import Redacted, SharedData

    data = {"target": "vault-7781", "tried": [{"check": "ok", "value": True}]}
    once = Redacted(data)

    first = once.get()
    assert first == data  # nothing to redact
    assert type(first) is SharedData  # shared by the events that hold it: encoded once
    assert once.get() is first

    register_secret("vault-7781")
    again = once.get()
    assert again == {"target": REDACTED, "tried": [{"check": "ok", "value": True}]}
    assert type(again) is SharedData
    assert again.encoded is None  # a new value: nothing encoded from the old one
    assert once.get() is again  # computed once for this registry
    assert data["target"] == "vault-7781"


def test_redact_lines() -> None:
    register_secret("s3cr3t-value")

    assert list(redact_lines(["a s3cr3t-value", "b"])) == [f"a {REDACTED}", "b"]


_MB = 1_000_000
_HOSTILE = {
    # (a megabyte that made a pattern backtrack: minutes, and doubling it quadrupled the time;
    # then a credential the pattern must still find after it; that credential redacted)
    "url: one word": ("a" * _MB + " ", "x://u:pw1@h", "x://u:[REDACTED]@h"),
    "url: letters, digits": ("a1" * (_MB // 2) + " ", "x://u:pw1@h", "x://u:[REDACTED]@h"),
    "url: schemes": ("a://" * (_MB // 4), "u:pw1@h", "u:[REDACTED]@h"),
    "url: endless user": ("x://" + "b" * _MB + " ", "x://u:pw1@h", "x://u:[REDACTED]@h"),
    "url: endless password": ("x://u:" + "p" * _MB, "", ""),
    "url: colons": ("://" + ":" * _MB, "", ""),
    "bearer: spaces": ("bearer" + " " * _MB, "tok123456", REDACTED),
    "auth: spaces": ("authorization" + " " * _MB, ": tok123", ": " + REDACTED),
    "auth: words": ("authorization: " + "ab " * (_MB // 3), "authorization=t0k123",
                    "authorization=" + REDACTED),
    "sk: keys": ("", "sk-" * (_MB // 3), "sk-" + REDACTED),
    "kw: unclosed quote": ("password='" + "a" * _MB + " ", "password=pw1", "password=" + REDACTED),
    "kw: spaces": ("password=" + " " * _MB, "pw1", REDACTED),
    "secret: prefixes": ("local-key-" * (_MB // 10), "local-key-0123456789", REDACTED),
}  # fmt: skip


@pytest.mark.parametrize(("head", "tail", "redacted"), _HOSTILE.values(), ids=_HOSTILE.keys())
def test_redaction_is_linear_on_a_megabyte_built_to_make_it_backtrack(
    head: str, tail: str, redacted: str
) -> None:
    register_secret("local-key-0123456789")

    assert redact(head + tail) == head + redacted


def test_lone_surrogates_leave_as_the_replacement_character() -> None:
    """A model's JSON escape or a tool's output may hold a lone surrogate, which UTF-8 cannot
    encode: a store or a terminal would refuse the event that carries it."""
    value = {"content": "bad \ud800 text", "short": "\udc80", "fine": "caf\u00e9 \U0001f600"}

    out = redact_data(value)

    assert out == {"content": "bad \ufffd text", "short": "\ufffd", "fine": value["fine"]}
    assert out["fine"] is value["fine"]  # nothing to repair: the same object
    json.dumps(out, ensure_ascii=False).encode("utf-8")  # now every way out takes it


def test_the_first_lone_surrogate_is_found_by_its_index() -> None:
    assert find_lone_surrogate("plain") == -1
    assert find_lone_surrogate("caf\u00e9 \U0001f600") == -1  # a pair is no lone surrogate
    assert find_lone_surrogate("ab\ud800 \udc80") == 2
    assert find_lone_surrogate("\u00e9\udc80") == 1


def test_encodable_text_is_returned_as_it_is() -> None:
    text = "caf\u00e9, d\u00e9j\u00e0 vu"

    assert encodable(text) is text
    assert encodable("x\ud800y") == "x\ufffdy"


STREAMED = [
    "key local-key-0123456789 sent",
    "Authorization: Basic dXNlcjpwYXNzd29yZA== then more",
    "header Bearer\n  tok987654321\nnext line",
    "dsn postgresql://bob:hunter22@db:5432/x ok",
    "set password = 'two words' and go on\nnew line",
    "the phrase my pass phrase here is secret",
]


def pieces_redacted(text: str, sizes: list[int]) -> str:
    """What a StreamRedactor releases for `text` cut into pieces of these sizes (the rest
    in one)."""
    redactor, out, at = StreamRedactor(), [], 0
    for size in sizes:
        out.append(redactor.feed(text[at : at + size]))
        at += size
    out.append(redactor.feed(text[at:]))
    out.append(redactor.close())
    return "".join(out)


@pytest.mark.parametrize("text", STREAMED)
def test_streamed_text_is_redacted_as_the_whole_text_is_at_every_split(text: str) -> None:
    register_secret("local-key-0123456789")
    register_secret("my pass phrase")  # a registered secret may hold spaces
    whole = redact(text)
    assert whole != text  # each text holds a secret

    for first in range(len(text) + 1):
        for second in range(0, len(text) - first + 1, 3):
            assert pieces_redacted(text, [first, second]) == whole, (first, second)
    assert pieces_redacted(text, [1] * len(text)) == whole  # a character a piece


def test_streamed_text_is_released_as_soon_as_no_secret_can_span_it() -> None:
    redactor = StreamRedactor()

    assert redactor.feed("Hello wor") == "Hello "  # a word may still be a key's start
    assert redactor.feed("ld, the password") == "world, the "
    assert redactor.feed(" is x\nok ") == "password is x\nok "  # the line ended it
    assert redactor.close() == ""


def test_a_streamed_line_that_never_ends_is_released_in_bounded_pieces() -> None:
    redactor = StreamRedactor()
    released = [redactor.feed("password " + "w " * 1000)]
    for _ in range(20_000):
        released.append(redactor.feed("word "))

    assert max(len(r) for r in released) < 10_000
    assert len("".join(released) + redactor.close()) == len("password " + "w " * 1000) + 100_000
