"""HttpChatModel over real HTTP to FakeOpenAIServer: answers, tool turns, quirks, retries,
timeouts and the translation of every failure into fsm_kernel.errors. No test waits for a real
backoff: `sleep` is injected and records the delays.

The client streams by default, and the fake streams every generated reply when asked, so these
tests run the streaming path unless they say `stream=False`; the answers and tool turns run both
ways. Stream-specific behaviour is in test_agent_streaming.py."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import json
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Coroutine, Iterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from fsm_kernel.agent import HttpChatModel
from fsm_kernel.config import AgentSettings
from fsm_kernel.errors import (
    AgentAuthError,
    AgentBadRequestError,
    AgentConnectionError,
    AgentError,
    AgentRateLimitError,
    AgentResponseError,
    AgentServerError,
    AgentTimeoutError,
    ConfigError,
)
from fsm_kernel.protocol import Completion, Message, Tool, ToolCall, ToolResult, Usage
from tests.fakes.openai_server import (
    FakeOpenAIServer,
    call,
    chunked,
    disconnect,
    hang,
    http_error,
    raw_body,
    reply_from_spec,
    text_reply,
    tool_reply,
    trickle,
)

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
READ_FILE = Tool(
    name="read_file",
    description="Read a text file",
    parameters={"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
)
HELLO = [Message.system("be brief"), Message.user("hello")]


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


class RecordingSleep:
    """The injected sleep: remembers each delay, never waits."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer() as fake:
        yield fake


@pytest.fixture
def sleep() -> RecordingSleep:
    return RecordingSleep()


@pytest.fixture(params=[True, False], ids=["streamed", "plain"])
def stream(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


STREAM_FIELDS = {"stream": True, "stream_options": {"include_usage": True}}


def settings_for(base_url: str, **overrides: Any) -> AgentSettings:
    values: dict[str, Any] = {"model": "test-model", "max_retries": 0, "request_timeout": 10.0}
    values.update(overrides)
    return AgentSettings(base_url=base_url, **values)


async def ask(
    base_url: str,
    messages: list[Message] = HELLO,
    tools: list[Tool] | None = None,
    *,
    sleep: RecordingSleep | None = None,
    random: float = 0.0,
    **overrides: Any,
) -> Completion:
    model = HttpChatModel(
        settings_for(base_url, **overrides),
        sleep=sleep or RecordingSleep(),
        random=lambda: random,
    )
    async with model:
        return await model.complete(messages, tools or [])


def expect(error: type[AgentError], base_url: str, **kwargs: Any) -> AgentError:
    with pytest.raises(error) as info:
        run(ask(base_url, **kwargs))
    assert "\n" not in str(info.value)
    return info.value


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- answers ---------------------------------------------------------------------------------


def test_text_answer(server: FakeOpenAIServer, stream: bool) -> None:
    server.enqueue(text_reply("hi there"))
    completion = run(ask(server.base_url, stream=stream))
    assert completion.message == Message.assistant("hi there")
    assert completion.finish_reason == "stop"
    assert completion.usage == Usage(prompt_tokens=10, completion_tokens=5, total_tokens=15)
    assert completion.model == "test-model"
    (request,) = server.requests
    assert request == {
        "model": "test-model",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello"},
        ],
        "max_tokens": 4096,  # the default cap on each reply
        **(STREAM_FIELDS if stream else {}),
    }
    assert server.request_headers[0]["content-type"] == "application/json"
    server.assert_complete()


def test_tools_and_temperature_are_sent_when_set(server: FakeOpenAIServer) -> None:
    server.enqueue(text_reply("ok"))
    run(ask(server.base_url, tools=[READ_FILE], temperature=0.2))
    (request,) = server.requests
    assert request["temperature"] == 0.2
    assert request["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "description": "Read a text file",
                "parameters": READ_FILE.parameters,
            },
        }
    ]


def test_reasoning_field_is_kept_out_of_content(server: FakeOpenAIServer, stream: bool) -> None:
    server.enqueue(text_reply("4", reasoning="2+2"))
    completion = run(ask(server.base_url, stream=stream))
    assert (completion.message.content, completion.message.reasoning) == ("4", "2+2")


def test_multi_turn_sends_tool_results_back(server: FakeOpenAIServer, stream: bool) -> None:
    server.enqueue(
        tool_reply(call("read_file", {"path": "a.txt"}, id="call_abc")),
        text_reply("the file says hi"),
    )

    async def conversation() -> tuple[Completion, Completion]:
        async with HttpChatModel(settings_for(server.base_url, stream=stream)) as model:
            first = await model.complete(HELLO, [READ_FILE])
            (tc,) = first.message.tool_calls
            history = [*HELLO, first.message, Message.tool(tc, ToolResult(content="hi"))]
            return first, await model.complete(history, [READ_FILE])

    first, second = run(conversation())
    assert first.finish_reason == "tool_calls"
    assert first.message.tool_calls == (
        ToolCall(id="call_abc", name="read_file", arguments={"path": "a.txt"}),
    )
    assert second.message.content == "the file says hi"
    assert server.requests[1]["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": '{"path": "a.txt"}'},
                }
            ],
        },
        {"role": "tool", "content": "hi", "tool_call_id": "call_abc", "name": "read_file"},
    ]
    server.assert_complete()  # the fake enforces OpenAI's ordering rules too


def test_parallel_tool_calls_in_one_response(server: FakeOpenAIServer, stream: bool) -> None:
    server.enqueue(
        tool_reply(
            call("read_file", {"path": "a"}, id="c1"),
            call("read_file", {"path": "b"}, id="c2"),
            call("now", {}, id="c3"),
        )
    )
    completion = run(ask(server.base_url, tools=[READ_FILE], stream=stream))
    calls = completion.message.tool_calls
    assert [(c.id, c.name, c.arguments) for c in calls] == [
        ("c1", "read_file", {"path": "a"}),
        ("c2", "read_file", {"path": "b"}),
        ("c3", "now", {}),
    ]


def _quirk(message: dict[str, Any], finish_reason: Any = None, **extra: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "message": message, "finish_reason": finish_reason}], **extra}


QUIRKS = [
    pytest.param(
        _quirk({"tool_calls": [{"id": "a", "function": {"name": "t", "arguments": {"x": 1}}}]}),
        lambda c: c.message.tool_calls[0].arguments == {"x": 1},
        id="arguments-as-object",
    ),
    pytest.param(
        _quirk({"tool_calls": [{"id": "a", "function": {"name": "t", "arguments": ""}}]}),
        lambda c: c.message.tool_calls[0].arguments == {},
        id="arguments-empty-string",
    ),
    pytest.param(
        _quirk({"tool_calls": [{"id": "a", "function": {"name": "t", "arguments": "{bad"}}]}),
        lambda c: (
            c.message.tool_calls[0].raw_arguments == "{bad"
            and c.message.tool_calls[0].arguments_error is not None
        ),
        id="arguments-invalid-json",
    ),
    pytest.param(
        _quirk(
            {
                "content": "",
                "tool_calls": [
                    {"id": "", "function": {"name": "a", "arguments": "{}"}},
                    {"function": {"name": "b", "arguments": "{}"}},
                ],
            }
        ),
        lambda c: (
            len({tc.id for tc in c.message.tool_calls}) == 2
            and all(tc.id for tc in c.message.tool_calls)
        ),
        id="missing-ids",
    ),
    pytest.param(
        _quirk(
            {
                "tool_calls": [
                    {"id": "call_0", "function": {"name": "a", "arguments": "{}"}},
                    {"id": "call_0", "function": {"name": "b", "arguments": "{}"}},
                ]
            }
        ),
        lambda c: (
            c.message.tool_calls[0].id == "call_0"
            and len({tc.id for tc in c.message.tool_calls}) == 2
        ),
        id="duplicate-ids",
    ),
    pytest.param(
        _quirk({"role": "assistant", "content": None}, "stop"),
        lambda c: c.message.content == "",
        id="content-null",
    ),
    pytest.param(
        _quirk({"content": "hi"}, None),
        lambda c: c.finish_reason == "stop",
        id="finish-reason-null",
    ),
    pytest.param(
        _quirk({"tool_calls": [{"id": "a", "function": {"name": "t"}}]}, "stop"),
        lambda c: c.finish_reason == "tool_calls",
        id="finish-reason-stop-with-calls",
    ),
    pytest.param(
        _quirk({"content": "hi"}, "end_turn"),
        lambda c: c.finish_reason == "stop",
        id="finish-reason-foreign",
    ),
    pytest.param(
        _quirk({"content": "<think>hmm</think>\n\nhello"}, "stop"),
        lambda c: (c.message.content, c.message.reasoning) == ("hello", "hmm"),
        id="think-in-content",
    ),
    pytest.param(
        _quirk({"content": "hello", "reasoning_content": "hmm"}, "stop"),
        lambda c: (c.message.content, c.message.reasoning) == ("hello", "hmm"),
        id="reasoning-content-field",
    ),
    pytest.param(
        _quirk({"content": "hello"}, "stop"),
        lambda c: c.usage == Usage() and c.model == "",
        id="no-usage-no-model",
    ),
]


@pytest.mark.parametrize(("body", "check"), QUIRKS)
def test_quirks_over_the_wire(server: FakeOpenAIServer, body: dict[str, Any], check: Any) -> None:
    server.enqueue(body)
    assert check(run(ask(server.base_url)))


# --- retries ---------------------------------------------------------------------------------


def test_429_honours_retry_after_then_succeeds(
    server: FakeOpenAIServer, sleep: RecordingSleep
) -> None:
    server.enqueue(http_error(429, headers={"Retry-After": "7"}), text_reply("ok"))
    completion = run(ask(server.base_url, sleep=sleep, max_retries=3))
    assert completion.message.content == "ok"
    assert sleep.delays == [7.0]
    assert len(server.requests) == 2


def test_retry_after_ms_wins_and_long_waits_are_capped(
    server: FakeOpenAIServer, sleep: RecordingSleep
) -> None:
    server.enqueue(
        http_error(429, headers={"retry-after-ms": "1500", "Retry-After": "9"}),
        http_error(503, headers={"Retry-After": "3600"}),
        text_reply("ok"),
    )
    run(ask(server.base_url, sleep=sleep, max_retries=3))
    assert sleep.delays == [1.5, 60.0]


def test_500_then_success_backs_off(server: FakeOpenAIServer, sleep: RecordingSleep) -> None:
    server.enqueue(http_error(500), text_reply("recovered"))
    completion = run(ask(server.base_url, sleep=sleep, max_retries=2))
    assert completion.message.content == "recovered"
    assert sleep.delays == [0.5]


def test_503_exhausting_retries(server: FakeOpenAIServer, sleep: RecordingSleep) -> None:
    server.enqueue(*[http_error(503, {"error": {"message": "overloaded"}})] * 4)
    err = expect(AgentServerError, server.base_url, sleep=sleep, max_retries=3, random=1.0)
    assert isinstance(err, AgentServerError)
    assert err.status_code == 503
    assert str(err) == f"model server at {server.base_url} failed with 503: overloaded"
    assert len(server.requests) == 4
    # 0.5, 1, 2 seconds, each shortened by the maximum jitter (25%)
    assert sleep.delays == [0.375, 0.75, 1.5]
    server.assert_complete()


def test_backoff_is_capped_at_eight_seconds(
    server: FakeOpenAIServer, sleep: RecordingSleep
) -> None:
    server.enqueue(*[http_error(502)] * 7)
    expect(AgentServerError, server.base_url, sleep=sleep, max_retries=6)
    assert sleep.delays == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]


def test_rate_limit_exhausted_keeps_retry_after(
    server: FakeOpenAIServer, sleep: RecordingSleep
) -> None:
    body = {"error": {"message": "Rate limit reached", "code": "rate_limit_exceeded"}}
    server.enqueue(http_error(429, body, {"Retry-After": "2"}))
    err = expect(AgentRateLimitError, server.base_url, sleep=sleep)
    assert isinstance(err, AgentRateLimitError)
    assert err.retry_after == 2.0
    assert "rate limiting requests (429): Rate limit reached" in str(err)
    assert sleep.delays == []


# --- timeouts and connections ----------------------------------------------------------------


def test_a_response_that_never_comes_times_out(server: FakeOpenAIServer) -> None:
    server.enqueue(hang(30))
    err = expect(AgentTimeoutError, server.base_url, request_timeout=0.2)
    assert str(err) == (
        f"model server at {server.base_url} timed out after 0.2s "
        "(to wait longer, raise --request-timeout, FSM_KERNEL_REQUEST_TIMEOUT or "
        "agent.request_timeout in the workflow)"
    )
    assert err.retryable


def test_a_timeout_is_retried(server: FakeOpenAIServer, sleep: RecordingSleep) -> None:
    server.enqueue(hang(30), text_reply("second try"))
    completion = run(ask(server.base_url, sleep=sleep, request_timeout=0.2, max_retries=1))
    assert completion.message.content == "second try"
    assert len(sleep.delays) == 1


@pytest.mark.parametrize(
    ("local_installed", "how"),
    [(True, "--model local"), (False, "pip install 'fsm-kernel[local]' (then --model local)")],
)
def test_connection_refused(
    sleep: RecordingSleep, monkeypatch: pytest.MonkeyPatch, local_installed: bool, how: str
) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        if name == "llama_cpp":
            return real_find_spec("json") if local_installed else None
        return real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    base_url = f"http://127.0.0.1:{closed_port()}/v1"
    err = expect(AgentConnectionError, base_url, sleep=sleep, max_retries=2)
    assert str(err) == (
        f"cannot reach model server at {base_url}: connection refused — is Ollama (or your "
        "model server) running? set --base-url or FSM_KERNEL_BASE_URL, or run the bundled model "
        f"offline: {how}"
    )
    assert err.base_url == base_url
    assert len(sleep.delays) == 2
    assert isinstance(err.__cause__, httpx.ConnectError)


def test_server_closing_the_connection_is_retried(
    server: FakeOpenAIServer, sleep: RecordingSleep
) -> None:
    server.enqueue(disconnect(), text_reply("ok"))
    assert run(ask(server.base_url, sleep=sleep, max_retries=1)).message.content == "ok"
    assert len(server.requests) == 2


def test_disconnect_without_retries_is_a_connection_error(server: FakeOpenAIServer) -> None:
    server.enqueue(disconnect())
    err = expect(AgentConnectionError, server.base_url)
    assert "closed the connection without answering" in str(err)


# --- the deadline of one attempt -------------------------------------------------------------


def test_a_trickling_answer_hits_the_deadline(server: FakeOpenAIServer) -> None:
    # Every read gets a byte within httpx's per-read timeout; only a deadline ends this.
    server.enqueue(trickle(raw_body("x" * 100), interval=0.1))
    started = time.monotonic()
    err = expect(AgentTimeoutError, server.base_url, request_timeout=1, max_retries=0)
    elapsed = time.monotonic() - started
    assert str(err) == (
        f"model server at {server.base_url} timed out after 1s "
        "(to wait longer, raise --request-timeout, FSM_KERNEL_REQUEST_TIMEOUT or "
        "agent.request_timeout in the workflow)"
    )
    assert elapsed < 5.0  # the whole body would take 10 s
    assert err.retryable


# A trickled stream is five times the bytes: these two run plain (streams: see
# test_agent_streaming.py).


def test_a_slow_answer_within_the_deadline_is_read_whole(server: FakeOpenAIServer) -> None:
    server.enqueue(trickle(text_reply("slow but sure"), interval=0.001))
    answer = run(ask(server.base_url, request_timeout=30, stream=False))
    assert answer.message.content == "slow but sure"


def test_request_timeout_zero_means_no_deadline(server: FakeOpenAIServer) -> None:
    server.enqueue(trickle(text_reply("no hurry"), interval=0.001))
    assert run(ask(server.base_url, request_timeout=0, stream=False)).message.content == "no hurry"


# --- the response size cap -------------------------------------------------------------------

SMALL_ANSWER = {"choices": [{"message": {"content": "ok"}}]}
SMALL_SIZE = len(json.dumps(SMALL_ANSWER).encode())


def test_a_declared_length_over_the_cap_is_refused_before_reading(
    server: FakeOpenAIServer, sleep: RecordingSleep
) -> None:
    server.enqueue(raw_body("x" * 100_000))
    err = expect(
        AgentResponseError, server.base_url, sleep=sleep, max_retries=3, max_response_bytes=1000
    )
    assert str(err) == (
        f"model server at {server.base_url} sent more than 1000 bytes (Content-Length 100000); "
        "raise --max-response-bytes or FSM_KERNEL_MAX_RESPONSE_BYTES to accept bigger answers"
    )
    assert len(server.requests) == 1  # not retried
    assert sleep.delays == []


def test_a_chunked_answer_over_the_cap_is_cut_while_streaming(server: FakeOpenAIServer) -> None:
    server.enqueue(chunked(raw_body("x" * 1_000_000)))
    err = expect(AgentResponseError, server.base_url, max_retries=3, max_response_bytes=1000)
    assert str(err) == (
        f"model server at {server.base_url} sent more than 1000 bytes; "
        "raise --max-response-bytes or FSM_KERNEL_MAX_RESPONSE_BYTES to accept bigger answers"
    )
    assert len(server.requests) == 1


def test_an_error_body_over_the_cap_is_refused_too(server: FakeOpenAIServer) -> None:
    server.enqueue(http_error(500, "y" * 100_000))
    err = expect(AgentResponseError, server.base_url, max_retries=3, max_response_bytes=1000)
    assert "sent more than 1000 bytes" in str(err)
    assert len(server.requests) == 1


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_an_answer_exactly_at_the_cap_is_accepted(server: FakeOpenAIServer, framing: str) -> None:
    reply = chunked(SMALL_ANSWER) if framing == "chunked" else SMALL_ANSWER
    server.enqueue(reply, reply)
    assert run(ask(server.base_url, max_response_bytes=SMALL_SIZE)).message.content == "ok"
    expect(AgentResponseError, server.base_url, max_response_bytes=SMALL_SIZE - 1)


# --- bodies and statuses that fail at once ---------------------------------------------------


def test_invalid_json_body_is_not_retried(server: FakeOpenAIServer, sleep: RecordingSleep) -> None:
    server.enqueue(raw_body('{"choices": [ this is not json'))
    err = expect(AgentResponseError, server.base_url, sleep=sleep, max_retries=3)
    assert str(err).startswith(
        f"model server at {server.base_url} sent a response that is not JSON"
    )
    assert len(server.requests) == 1
    assert sleep.delays == []


def test_body_without_choices_is_a_response_error(server: FakeOpenAIServer) -> None:
    server.enqueue({"object": "chat.completion"})
    err = expect(AgentResponseError, server.base_url, max_retries=3)
    assert str(err) == f"model server at {server.base_url} sent an unusable response: " + (
        "response has no choices"
    )
    assert len(server.requests) == 1


def test_401_fails_at_once(server: FakeOpenAIServer, sleep: RecordingSleep) -> None:
    body = {
        "error": {"message": "Incorrect API key provided: sk-abc***", "code": "invalid_api_key"}
    }
    server.enqueue(http_error(401, body))
    err = expect(AgentAuthError, server.base_url, sleep=sleep, max_retries=3, api_key="sk-abcdef")
    assert str(err) == (
        f"model server at {server.base_url} rejected the API key (401): Incorrect API key "
        "provided: sk-abc*** — check FSM_KERNEL_API_KEY"
    )
    assert len(server.requests) == 1
    assert sleep.delays == []


def test_401_without_a_key_says_to_set_one(server: FakeOpenAIServer) -> None:
    server.enqueue(http_error(401, "Unauthorized"))
    err = expect(AgentAuthError, server.base_url)
    assert str(err).endswith("(401): Unauthorized — no key was sent; set FSM_KERNEL_API_KEY")


@pytest.mark.parametrize(
    "body",
    [
        {
            "error": {
                "code": "model_not_found",
                "message": "The model `test-model` does not exist or you do not have access to it.",
                "type": "invalid_request_error",
            }
        },
        {"error": 'model "test-model" not found, try pulling it first'},  # Ollama
        {"object": "error", "message": "The model `test-model` does not exist.", "code": 404},
    ],
    ids=["openai", "ollama", "vllm-flat"],
)
def test_404_model_not_found(server: FakeOpenAIServer, body: dict[str, Any]) -> None:
    server.enqueue(http_error(404, body))
    err = expect(AgentBadRequestError, server.base_url, max_retries=3)
    assert isinstance(err, AgentBadRequestError)
    assert err.status_code == 404
    assert f"model server at {server.base_url} answered 404: model 'test-model' not found (" in str(
        err
    )
    assert str(err).endswith("— check --model or FSM_KERNEL_MODEL")
    assert len(server.requests) == 1


def test_wrong_base_url_path_gets_a_hint(server: FakeOpenAIServer) -> None:
    base = server.base_url.removesuffix("/v1")
    err = expect(AgentBadRequestError, base)
    assert str(err) == (
        f"model server at {base} answered 404: unknown path /chat/completions — is the base "
        "URL right? It usually ends in /v1"
    )
    assert server.errors == ["POST to unknown path /chat/completions"]


def test_long_error_bodies_are_cut(server: FakeOpenAIServer) -> None:
    server.enqueue(http_error(400, "x" * 5000 + "\n" + "y" * 10))
    err = expect(AgentBadRequestError, server.base_url)
    assert len(str(err)) < 500
    assert str(err).endswith("…")
    assert isinstance(err, AgentBadRequestError)
    assert len(err.body) <= 2000


def test_server_without_tool_support_is_not_retried(
    server: FakeOpenAIServer, sleep: RecordingSleep
) -> None:
    body = {"error": {"code": 500, "message": "tools param requires --jinja flag"}}
    server.enqueue(http_error(500, body))
    err = expect(AgentBadRequestError, server.base_url, sleep=sleep, max_retries=3)
    assert str(err).endswith(
        "tools param requires --jinja flag — the model or server cannot call tools"
    )
    assert sleep.delays == []


# --- credentials -----------------------------------------------------------------------------


def test_bearer_header_only_when_a_key_is_set(server: FakeOpenAIServer) -> None:
    server.enqueue(text_reply("a"), text_reply("b"))
    run(ask(server.base_url, api_key="sk-test-123"))
    run(ask(server.base_url))
    with_key, without_key = server.request_headers
    assert with_key["authorization"] == "Bearer sk-test-123"
    assert "authorization" not in without_key


def test_api_key_never_reaches_the_logs(
    server: FakeOpenAIServer, sleep: RecordingSleep, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    secret = "sk-very-secret-key-42"
    server.enqueue(http_error(500), text_reply("ok"), http_error(401))
    run(ask(server.base_url, sleep=sleep, max_retries=1, api_key=secret))
    with pytest.raises(AgentAuthError) as info:
        run(ask(server.base_url, api_key=secret))
    assert server.request_headers[0]["authorization"] == f"Bearer {secret}"
    assert any(r.name == "fsm_kernel.agent.client" for r in caplog.records)
    assert any(r.levelno == logging.WARNING for r in caplog.records)  # the retry was logged
    for record in caplog.records:
        assert secret not in record.getMessage()
    assert secret not in caplog.text
    assert secret not in str(info.value)
    assert secret not in repr(HttpChatModel(settings_for(server.base_url, api_key=secret)).settings)


# --- construction ----------------------------------------------------------------------------


@pytest.mark.parametrize("base_url", ["localhost:11434/v1", "ftp://host/v1", "http://"])
def test_unusable_base_url_is_a_config_error(base_url: str) -> None:
    with pytest.raises(ConfigError, match="invalid model server URL"):
        HttpChatModel(settings_for(base_url))


def test_trailing_slash_in_base_url(server: FakeOpenAIServer) -> None:
    server.enqueue(text_reply("ok"))
    assert run(ask(server.base_url + "/")).message.content == "ok"


def test_one_model_serves_several_event_loops() -> None:
    # Kernel.run_sync and the scheduler call asyncio.run once per run with one model; a real
    # server keeps connections alive, and such a connection belongs to the loop that opened it.
    with FakeOpenAIServer(keep_alive=True) as server:
        server.enqueue(text_reply("one"), text_reply("two"), text_reply("three"))
        model = HttpChatModel(settings_for(server.base_url))
        answers = [run(model.complete(HELLO, [])).message.content for _ in range(3)]
        run(model.aclose())
        gc.collect()  # an unclosed socket from an earlier loop would warn here (an error)
    assert answers == ["one", "two", "three"]


def test_aclose_twice_is_harmless_and_a_closed_client_says_so(server: FakeOpenAIServer) -> None:
    async def use() -> None:
        model = HttpChatModel(settings_for(server.base_url))
        await model.aclose()
        await model.aclose()
        with pytest.raises(AgentError, match=r"model client for .* is closed") as closed:
            await model.complete([Message.user("hi")], [])
        assert type(closed.value) is AgentError
        assert closed.value.retryable is False

    run(use())
    assert server.requests == []  # nothing was sent


# --- the transport seam (httpx.MockTransport) ------------------------------------------------


def mock_model(handler: Any, sleep: RecordingSleep, **overrides: Any) -> HttpChatModel:
    return HttpChatModel(
        settings_for("http://model.test/v1", **overrides),
        transport=httpx.MockTransport(handler),
        sleep=sleep,
        random=lambda: 0.0,
    )


async def mock_ask(handler: Any, sleep: RecordingSleep, **overrides: Any) -> Completion:
    async with mock_model(handler, sleep, **overrides) as model:
        return await model.complete(HELLO, [])


def test_mock_transport_read_timeout_and_http_date_retry_after(sleep: RecordingSleep) -> None:
    answers: list[Any] = []

    def handler(request: httpx.Request) -> httpx.Response:
        answers.append(request.url)
        if len(answers) == 1:
            raise httpx.ReadTimeout("read timed out", request=request)
        if len(answers) == 2:
            when = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
            return httpx.Response(429, headers={"Retry-After": when}, text="slow down")
        return httpx.Response(200, json={"choices": [{"message": {"content": "ok"}}]})

    completion = run(mock_ask(handler, sleep, max_retries=2))
    assert completion.message.content == "ok"
    assert str(answers[0]) == "http://model.test/v1/chat/completions"
    assert sleep.delays[0] == 0.5
    assert 25.0 < sleep.delays[1] <= 30.0


@pytest.mark.parametrize(
    ("status", "error", "retried"),
    [
        (400, AgentBadRequestError, False),
        (403, AgentAuthError, False),
        (408, AgentServerError, True),
        (409, AgentServerError, True),
        (422, AgentBadRequestError, False),
        (429, AgentRateLimitError, True),
        (502, AgentServerError, True),
    ],
)
def test_mock_transport_status_mapping(
    sleep: RecordingSleep, status: int, error: type[AgentError], retried: bool
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json={"error": {"message": "nope"}})

    with pytest.raises(error) as info:
        run(mock_ask(handler, sleep, max_retries=1))
    assert type(info.value) is error
    assert len(sleep.delays) == (1 if retried else 0)
    assert str(info.value).startswith("model server at http://model.test/v1 ")
    assert "nope" in str(info.value)


def test_mock_transport_nothing_from_httpx_escapes(sleep: RecordingSleep) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("peer closed connection", request=request)

    with pytest.raises(AgentConnectionError) as info:
        run(mock_ask(handler, sleep))
    assert isinstance(info.value.__cause__, httpx.HTTPError)


# --- the fake server itself (other tests rely on it) -----------------------------------------


def test_fake_server_reports_a_script_that_ran_out(server: FakeOpenAIServer) -> None:
    err = expect(AgentServerError, server.base_url)
    assert "fake server: the script ran out of replies" in str(err)
    assert server.errors == ["the script ran out of replies (request #1 got none)"]
    with pytest.raises(AssertionError, match="ran out"):
        server.assert_complete()


def test_fake_server_enforces_tool_message_order(server: FakeOpenAIServer) -> None:
    orphan = [Message.user("hi"), Message.tool(ToolCall(id="x", name="t"), ToolResult(content="r"))]
    server.enqueue(text_reply("unused"))
    err = expect(AgentBadRequestError, server.base_url, messages=orphan)
    assert "messages with role 'tool' must be a response to a preceeding message" in str(err)
    assert server.pending == 1


def test_fake_server_callable_replies_see_the_request(server: FakeOpenAIServer) -> None:
    server.enqueue(lambda request: text_reply(f"{len(request['messages'])} messages"))
    assert run(ask(server.base_url)).message.content == "2 messages"


def test_fake_server_script_mode_in_a_subprocess(tmp_path: Path) -> None:
    script = tmp_path / "replies.json"
    log = tmp_path / "requests.jsonl"
    script.write_text(
        json.dumps(
            [
                {"tool_calls": [{"name": "read_file", "arguments": {"path": "a"}, "id": "c1"}]},
                {"status": 503},
                {"text": "done", "reasoning": "easy"},
            ]
        )
    )
    command = [sys.executable, "-m", "tests.fakes.openai_server", "--script", str(script)]
    command += ["--requests-log", str(log)]
    with subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()
            assert line.startswith("READY http://127.0.0.1:")
            base_url = line.removeprefix("READY ")
            first = run(ask(base_url))
            (tc,) = first.message.tool_calls
            history = [*HELLO, first.message, Message.tool(tc, ToolResult(content="A"))]
            sleep = RecordingSleep()
            last = run(ask(base_url, history, sleep=sleep, max_retries=1))
        finally:
            proc.terminate()
        assert proc.wait(timeout=10) == 0
    assert (last.message.content, last.message.reasoning) == ("done", "easy")
    assert len(sleep.delays) == 1
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(logged) == 3
    assert logged[2]["messages"][-1] == {
        "role": "tool",
        "content": "A",
        "tool_call_id": "c1",
        "name": "read_file",
    }


def test_fake_server_reply_specs_for_delivery_and_echo() -> None:
    trickled = reply_from_spec({"trickle": 0.25, "then": {"raw": "abc"}})
    assert (trickled.text, trickled.byte_interval) == ("abc", 0.25)
    framed = reply_from_spec({"chunked": True, "then": "hi"})
    assert framed.chunked
    assert framed.completion
    echoing = reply_from_spec({"status": 401, "echo_auth": True})
    assert (echoing.status, echoing.echo_auth) == (401, True)
    assert not reply_from_spec({"status": 401}).echo_auth


def test_fake_server_echoes_the_authorization_header(server: FakeOpenAIServer) -> None:
    server.enqueue(http_error(401, echo_auth=True))
    with pytest.raises(AgentAuthError) as info:
        run(ask(server.base_url, api_key="fake-echo-key"))
    body = json.loads(info.value.body)
    # The client hides the key; the fake did put it there.
    assert body["request"]["headers"]["authorization"] == "Bearer [REDACTED]"
    assert body["error"]["message"] == "fake server error 401: bad key [REDACTED]"


def test_fake_server_script_mode_rejects_a_bad_script(tmp_path: Path) -> None:
    script = tmp_path / "bad.json"
    script.write_text(json.dumps([{"what": 1}]))
    command = [sys.executable, "-m", "tests.fakes.openai_server", "--script", str(script)]
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 2
    assert "unknown reply spec" in done.stderr
