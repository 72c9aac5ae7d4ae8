"""The API key never leaves HttpChatModel, even when a server echoes it back: over real loopback
HTTP to FakeOpenAIServer answering with the request's Authorization header in its error bodies
(as some proxies do on 401 and in 5xx pages), the key must appear in no part of the exception
(str, message, body, repr, to_dict, a pickled copy, its cause) and in no log record."""

from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import Iterator
from typing import Any

import pytest

from fsm_kernel.agent import HttpChatModel
from fsm_kernel.config import AgentSettings
from fsm_kernel.errors import (
    AgentAuthError,
    AgentError,
    AgentHTTPError,
    AgentResponseError,
    AgentServerError,
)
from fsm_kernel.protocol import Message
from fsm_kernel.redact import REDACTED, _forget_secrets, redact, registered_secrets
from tests.fakes.openai_server import (
    API_KEY,
    AUTHORIZATION,
    FakeOpenAIServer,
    Reply,
    http_error,
    raw_body,
)

SK_KEY = "sk-test-0123456789abcdefSECRET"
LOCAL_KEY = "local-key-0123456789"
"""Looks like no known credential: only its registration by HttpChatModel can hide it."""
KEYS = [pytest.param(SK_KEY, id="sk-key"), pytest.param(LOCAL_KEY, id="unshaped-key")]
HELLO = [Message.user("hello")]


class NoSleep:
    """The injected sleep: retries happen at once."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, seconds: float) -> None:
        self.calls += 1


@pytest.fixture(autouse=True)
def _fresh_registry() -> Iterator[None]:
    # Each test must show that HttpChatModel itself registers the key, not an earlier test.
    _forget_secrets()
    yield
    _forget_secrets()


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


def fail(server: FakeOpenAIServer, key: str, *, max_retries: int = 0) -> AgentError:
    """Ask once with `key` and return the AgentError it ends in."""
    settings = AgentSettings(
        base_url=server.base_url, model="m", api_key=key, max_retries=max_retries
    )

    async def ask() -> None:
        async with HttpChatModel(settings, sleep=NoSleep()) as model:
            await model.complete(HELLO, [])

    with pytest.raises(AgentError) as info:
        asyncio.run(ask())
    assert server.request_headers[0]["authorization"] == f"Bearer {key}"  # it was sent
    return info.value


def assert_hidden(key: str, exc: AgentError, caplog: pytest.LogCaptureFixture) -> None:
    """`key` is in no part of `exc` nor in any log record."""
    parts: list[Any] = [str(exc), exc.message, repr(exc), exc.to_dict(), exc.args, vars(exc)]
    parts.append(repr(pickle.loads(pickle.dumps(exc))))
    cause = exc.__cause__
    while cause is not None:
        parts += [str(cause), repr(cause), vars(cause)]
        cause = cause.__cause__
    for part in parts:
        assert key not in str(part)
    assert key not in caplog.text
    for record in caplog.records:
        assert key not in record.getMessage()


# --- echoed keys ----------------------------------------------------------------------------


@pytest.mark.parametrize("key", KEYS)
def test_a_401_echoing_the_key(
    server: FakeOpenAIServer, caplog: pytest.LogCaptureFixture, key: str
) -> None:
    caplog.set_level(logging.DEBUG)
    server.enqueue(http_error(401, echo_auth=True))

    err = fail(server, key, max_retries=3)

    assert isinstance(err, AgentAuthError)
    assert_hidden(key, err, caplog)
    assert f"bad key {REDACTED}" in err.message  # the server did echo it, and it was caught
    assert REDACTED in err.body
    assert len(server.requests) == 1


@pytest.mark.parametrize("key", KEYS)
def test_a_500_echoing_the_key_until_the_retries_run_out(
    server: FakeOpenAIServer, caplog: pytest.LogCaptureFixture, key: str
) -> None:
    caplog.set_level(logging.DEBUG)
    server.enqueue(*[http_error(500, echo_auth=True)] * 3)

    err = fail(server, key, max_retries=2)

    assert isinstance(err, AgentServerError)
    assert_hidden(key, err, caplog)
    assert len(server.requests) == 3
    retries = [r for r in caplog.records if r.levelno == logging.WARNING and "retry" in r.msg]
    assert len(retries) == 2
    assert all(REDACTED in r.getMessage() for r in retries)


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize(
    "body",
    [
        f"upstream rejected key {API_KEY}",
        f"POST /v1/chat/completions\nAuthorization: {AUTHORIZATION}\nUser-Agent: fsm-kernel",
        {"detail": {"headers": {"authorization": AUTHORIZATION}}, "key": API_KEY},
        # A key as long as the message limit would be cut in half; the cut must come after.
        "x" * 290 + f" {API_KEY}",
    ],
    ids=["text", "header-dump", "json-elsewhere", "cut-at-the-limit"],
)
def test_error_bodies_of_every_shape(
    server: FakeOpenAIServer, caplog: pytest.LogCaptureFixture, key: str, body: Any
) -> None:
    caplog.set_level(logging.DEBUG)
    server.enqueue(http_error(502, body, echo_auth=True))

    err = fail(server, key)

    assert isinstance(err, AgentHTTPError)
    assert_hidden(key, err, caplog)
    assert key[:8] not in err.message  # not even a prefix left by the cut


@pytest.mark.parametrize("key", KEYS)
def test_a_non_json_answer_echoing_the_key(
    server: FakeOpenAIServer, caplog: pytest.LogCaptureFixture, key: str
) -> None:
    caplog.set_level(logging.DEBUG)
    server.enqueue(raw_body(f"<html>proxy: your key {API_KEY} is fine</html>", echo_auth=True))

    err = fail(server, key)

    assert isinstance(err, AgentResponseError)
    assert "not JSON" in err.message
    assert_hidden(key, err, caplog)
    assert err.__cause__ is None  # the JSON decoder keeps the whole body in `.doc`


@pytest.mark.parametrize("key", KEYS)
def test_a_200_carrying_an_error_that_echoes_the_key(
    server: FakeOpenAIServer, caplog: pytest.LogCaptureFixture, key: str
) -> None:
    caplog.set_level(logging.DEBUG)
    server.enqueue(Reply(body={"error": f"quota exceeded for {API_KEY}"}, echo_auth=True))

    err = fail(server, key)

    assert isinstance(err, AgentResponseError)
    assert "response carries an error: quota exceeded for" in err.message
    assert_hidden(key, err, caplog)


# --- registration and the base URL -----------------------------------------------------------


def test_building_the_model_registers_the_key() -> None:
    assert LOCAL_KEY not in registered_secrets()

    HttpChatModel(AgentSettings(api_key=LOCAL_KEY))

    assert LOCAL_KEY in registered_secrets()
    assert redact(f"key={LOCAL_KEY}.") == f"key={REDACTED}."


def test_a_password_in_the_base_url_is_hidden(
    server: FakeOpenAIServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    password = "hunter2-0123456789"
    base_url = server.base_url.replace("http://", f"http://user:{password}@")
    server.enqueue(http_error(500))
    settings = AgentSettings(base_url=base_url, model="m", max_retries=1)

    async def ask() -> None:
        async with HttpChatModel(settings, sleep=NoSleep()) as model:
            await model.complete(HELLO, [])

    with pytest.raises(AgentServerError) as info:
        asyncio.run(ask())

    assert_hidden(password, info.value, caplog)
    assert server.request_headers[0]["authorization"].startswith("Basic ")
    assert info.value.base_url == base_url.replace(password, REDACTED)
