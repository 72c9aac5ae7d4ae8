"""HttpChatModel streaming over real HTTP to FakeOpenAIServer: text deltas handed to the
fsm_kernel.streaming sink as they arrive, tool calls assembled from fragments (OpenAI) or whole
deltas (Ollama), streams cut in the middle (retried, watchers told), plain answers to streaming
requests, bad streams (one fallback per model), mid-stream errors, and the deadline and size cap
holding for streams. No test waits for a real backoff: `sleep` is injected."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from fsm_kernel.agent import HttpChatModel
from fsm_kernel.config import AgentSettings
from fsm_kernel.errors import (
    AgentBadRequestError,
    AgentConnectionError,
    AgentError,
    AgentRateLimitError,
    AgentResponseError,
    AgentServerError,
    AgentTimeoutError,
)
from fsm_kernel.protocol import Completion, Message, Tool, Usage
from fsm_kernel.streaming import StreamNotice, TextDelta, deltas_to
from tests.fakes.openai_server import (
    OLLAMA_STYLE,
    FakeOpenAIServer,
    StreamStyle,
    call,
    http_error,
    reply_from_spec,
    sse_reply,
    streamed,
    text_reply,
    tool_reply,
    trickle,
)

T = TypeVar("T")
HELLO = [Message.system("be brief"), Message.user("hello")]
TOOL = Tool(name="read_file", description="Read a file", parameters={"type": "object"})
STREAM_FIELDS = {"stream": True, "stream_options": {"include_usage": True}}
Item = TextDelta | StreamNotice


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


def settings_for(base_url: str, **overrides: Any) -> AgentSettings:
    values: dict[str, Any] = {"model": "test-model", "max_retries": 0, "request_timeout": 10.0}
    values.update(overrides)
    return AgentSettings(base_url=base_url, **values)


def watch(coro: Coroutine[Any, Any, T]) -> tuple[T, list[Item]]:
    """Run `coro` with a sink installed; what it returned and what the sink got."""
    seen: list[Item] = []
    with deltas_to(seen.append):
        result = asyncio.run(coro)
    return result, seen


async def ask(
    base_url: str,
    tools: list[Tool] | None = None,
    *,
    sleep: RecordingSleep | None = None,
    **overrides: Any,
) -> Completion:
    async with HttpChatModel(
        settings_for(base_url, **overrides), sleep=sleep or RecordingSleep()
    ) as model:
        return await model.complete(HELLO, tools or [])


def texts(seen: list[Item]) -> list[str]:
    return [item.text for item in seen if isinstance(item, TextDelta)]


def notices(seen: list[Item]) -> list[StreamNotice]:
    return [item for item in seen if isinstance(item, StreamNotice)]


def expect(
    error: type[AgentError], coro: Coroutine[Any, Any, Any]
) -> tuple[AgentError, list[Item]]:
    seen: list[Item] = []
    with deltas_to(seen.append), pytest.raises(error) as info:
        asyncio.run(coro)
    assert "\n" not in str(info.value)
    return info.value, seen


def chunk(**fields: Any) -> dict[str, Any]:
    finish = fields.pop("finish_reason", None)
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": finish}]}


# --- answers ---------------------------------------------------------------------------------


def test_text_deltas_arrive_in_order_and_are_emitted(server: FakeOpenAIServer) -> None:
    server.enqueue(text_reply("Streaming, one piece at a time."))
    completion, seen = watch(ask(server.base_url))
    assert completion.message == Message.assistant("Streaming, one piece at a time.")
    assert (completion.finish_reason, completion.model) == ("stop", "test-model")
    assert texts(seen) == [
        "Str",
        "eam",
        "ing",
        ", o",
        "ne ",
        "pie",
        "ce ",
        "at ",
        "a t",
        "ime",
        ".",
    ]
    assert notices(seen) == []
    assert server.requests[0] == {
        "model": "test-model",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello"},
        ],
        "max_tokens": 4096,  # the default cap on each reply
        **STREAM_FIELDS,
    }
    assert server.request_headers[0]["accept"] == "text/event-stream, application/json"
    server.assert_complete()


def test_reasoning_is_never_emitted(server: FakeOpenAIServer) -> None:
    server.enqueue(
        text_reply("4", reasoning="two and two"),
        text_reply("<think>the user greets</think>\n\nHello!"),
    )
    first, seen_first = watch(ask(server.base_url))
    second, seen_second = watch(ask(server.base_url))
    assert (first.message.content, first.message.reasoning) == ("4", "two and two")
    assert "".join(texts(seen_first)) == "4"
    assert (second.message.content, second.message.reasoning) == ("Hello!", "the user greets")
    assert "".join(texts(seen_second)) == "Hello!"


def test_stream_off_sends_no_stream_fields_and_emits_nothing(server: FakeOpenAIServer) -> None:
    server.enqueue(text_reply("plain"))
    completion, seen = watch(ask(server.base_url, stream=False))
    assert completion.message.content == "plain"
    assert seen == []
    assert "stream" not in server.requests[0]
    assert "stream_options" not in server.requests[0]


# --- tool calls ------------------------------------------------------------------------------


def test_chunked_tool_call_arguments_openai_style(server: FakeOpenAIServer) -> None:
    arguments = {"path": "docs/a long file name.txt", "encoding": "utf-8"}
    server.enqueue(
        streamed(tool_reply(call("read_file", arguments, id="call_x")), StreamStyle(args_piece=2))
    )
    completion, seen = watch(ask(server.base_url, [TOOL]))
    (tc,) = completion.message.tool_calls
    assert (tc.id, tc.name, tc.arguments) == ("call_x", "read_file", arguments)
    assert completion.finish_reason == "tool_calls"
    assert texts(seen) == []


def test_parallel_tool_calls_streamed(server: FakeOpenAIServer) -> None:
    server.enqueue(
        tool_reply(
            call("read_file", {"path": "a"}, id="c1"),
            call("read_file", {"path": "b"}, id="c2"),
            call("now", {}, id="c3"),
            content="Reading both.",
        )
    )
    completion, seen = watch(ask(server.base_url, [TOOL]))
    assert [(c.id, c.name, c.arguments) for c in completion.message.tool_calls] == [
        ("c1", "read_file", {"path": "a"}),
        ("c2", "read_file", {"path": "b"}),
        ("c3", "now", {}),
    ]
    assert completion.message.content == "Reading both."
    assert "".join(texts(seen)) == "Reading both."


@pytest.mark.parametrize(
    "style",
    [OLLAMA_STYLE, StreamStyle(args_piece=0, call_index="none", repeat_role=True)],
    ids=["index-0", "no-index"],
)
def test_ollama_style_whole_calls(style: StreamStyle) -> None:
    with FakeOpenAIServer(stream_style=style) as server:
        server.enqueue(
            tool_reply(
                call("read_file", {"path": "a"}, id="call_a"),
                call("read_file", {"path": "b"}, id="call_b"),
                content="",
            )
        )
        completion, _ = watch(ask(server.base_url, [TOOL]))
    assert [(c.id, c.arguments) for c in completion.message.tool_calls] == [
        ("call_a", {"path": "a"}),
        ("call_b", {"path": "b"}),
    ]
    assert completion.finish_reason == "tool_calls"


def test_calls_without_ids_get_ids(server: FakeOpenAIServer) -> None:
    style = StreamStyle(call_ids=False, args_piece=3)
    server.enqueue(streamed(tool_reply(call("a", {"x": 1}), call("b", {"y": 2})), style))
    completion, _ = watch(ask(server.base_url, [TOOL]))
    calls = completion.message.tool_calls
    assert [(c.name, c.arguments) for c in calls] == [("a", {"x": 1}), ("b", {"y": 2})]
    assert len({c.id for c in calls}) == 2
    assert all(len(c.id) == 9 for c in calls)


# --- the shapes of the end of a stream ---------------------------------------------------------


def test_usage_only_final_chunk(server: FakeOpenAIServer) -> None:
    usage = {"prompt_tokens": 53, "completion_tokens": 15, "total_tokens": 68}
    server.enqueue(text_reply("counted", usage=usage))
    completion, _ = watch(ask(server.base_url))
    assert completion.usage == Usage(prompt_tokens=53, completion_tokens=15, total_tokens=68)


@pytest.mark.parametrize(
    ("style", "usage"),
    [
        (StreamStyle(usage="none"), Usage()),
        (
            StreamStyle(usage="finish"),
            Usage(prompt_tokens=10, completion_tokens=5, total_tokens=15),
        ),
    ],
    ids=["no-usage", "usage-on-finish"],
)
def test_usage_elsewhere_or_nowhere(
    server: FakeOpenAIServer, style: StreamStyle, usage: Usage
) -> None:
    server.enqueue(streamed(text_reply("ok"), style))
    assert watch(ask(server.base_url))[0].usage == usage


def test_crlf_pings_and_a_null_finish_reason(server: FakeOpenAIServer) -> None:
    style = StreamStyle(crlf=True, ping=True, finish_reason=False, usage="none")
    server.enqueue(
        streamed(text_reply("windows line ends"), style),
        streamed(tool_reply(call("read_file", {"path": "a"}, id="c1")), style),
    )
    text, seen = watch(ask(server.base_url))
    tools, _ = watch(ask(server.base_url, [TOOL]))
    assert (text.message.content, text.finish_reason) == ("windows line ends", "stop")
    assert "".join(texts(seen)) == "windows line ends"
    assert tools.finish_reason == "tool_calls"
    assert tools.message.tool_calls[0].arguments == {"path": "a"}


def test_a_finished_stream_without_done_is_whole(server: FakeOpenAIServer) -> None:
    # The body ends after the finish chunk: cleanly, then with the connection dropped.
    dropped = StreamStyle(done=False, usage="none", cut_after=99)
    server.enqueue(
        streamed(text_reply("no goodbye"), StreamStyle(done=False)),
        streamed(text_reply("dropped after"), dropped),
    )
    assert watch(ask(server.base_url))[0].message.content == "no goodbye"
    assert watch(ask(server.base_url))[0].message.content == "dropped after"


def test_a_stream_dropped_just_before_its_finish_is_broken_off(server: FakeOpenAIServer) -> None:
    # Six deltas (the role, then five pieces of text), the finish chunk never sent.
    server.enqueue(streamed(text_reply("dropped before"), StreamStyle(cut_after=6)))
    _, seen = expect(AgentConnectionError, ask(server.base_url))
    assert "".join(texts(seen)) == "dropped before"


def test_a_plain_json_answer_to_a_streaming_request() -> None:
    with FakeOpenAIServer(stream_style=None) as server:
        server.enqueue(text_reply("whole at once", reasoning="quietly"), text_reply("again"))
        completion, seen = watch(ask(server.base_url))
        assert server.requests[0]["stream"] is True
        assert completion.message.content == "whole at once"
        assert completion.usage.total_tokens == 15
        # Watchers still see the answer (all at once), never its reasoning; no fallback.
        assert seen == [TextDelta("whole at once")]
        assert watch(ask(server.base_url))[0].message.content == "again"
        assert server.requests[1]["stream"] is True


# --- streams cut in the middle -------------------------------------------------------------------


def test_a_stream_cut_in_the_middle_is_retried(server: FakeOpenAIServer) -> None:
    sleep = RecordingSleep()
    server.enqueue(
        streamed(text_reply("hello there world"), StreamStyle(cut_after=4)),
        text_reply("hello there world"),
    )
    completion, seen = watch(ask(server.base_url, sleep=sleep, max_retries=2))
    assert completion.message.content == "hello there world"
    assert len(server.requests) == 2
    assert server.requests[1] == server.requests[0]  # the whole request, redone
    assert len(sleep.delays) == 1
    (notice,) = notices(seen)
    assert notice.kind == "stream_restarted"
    assert notice.detail["attempt"] == 2
    assert "broke off the stream before the answer was complete" in notice.detail["reason"]
    # What was shown before the cut, then the notice, then the whole answer again.
    at = seen.index(notice)
    assert "".join(texts(seen[:at])) == "hello the"  # the role chunk, then three pieces
    assert "".join(texts(seen[at + 1 :])) == "hello there world"


def test_a_stream_that_ends_before_its_answer_is_a_connection_error(
    server: FakeOpenAIServer,
) -> None:
    # A clean end of the body, but no finish reason and no [DONE].
    server.enqueue(sse_reply(chunk(role="assistant", content="half an ans"), done=False))
    err, seen = expect(AgentConnectionError, ask(server.base_url))
    assert str(err) == (
        f"model server at {server.base_url} broke off the stream before the answer was complete"
    )
    assert err.retryable
    assert texts(seen) == ["half an ans"]
    assert notices(seen) == []  # no retry, nothing to restart


def test_a_cut_stream_exhausting_retries(server: FakeOpenAIServer) -> None:
    sleep = RecordingSleep()
    cut = streamed(text_reply("never whole"), StreamStyle(cut_after=2))
    server.enqueue(cut, cut)
    _, seen = expect(AgentConnectionError, ask(server.base_url, sleep=sleep, max_retries=1))
    assert [n.detail["attempt"] for n in notices(seen)] == [2]
    assert len(server.requests) == 2


# --- errors inside the stream --------------------------------------------------------------------


def test_a_mid_stream_server_error_is_retried(server: FakeOpenAIServer) -> None:
    sleep = RecordingSleep()
    error = {
        "error": {"message": "overloaded", "type": "server_error", "param": None, "code": None}
    }
    server.enqueue(sse_reply(chunk(content="par"), error), text_reply("recovered"))
    completion, seen = watch(ask(server.base_url, sleep=sleep, max_retries=1))
    assert completion.message.content == "recovered"
    (notice,) = notices(seen)
    assert notice.detail["reason"] == (
        f"model server at {server.base_url} failed with 500: overloaded "
        "(reported in the middle of the stream)"
    )


def test_a_mid_stream_bad_request_is_not_retried(server: FakeOpenAIServer) -> None:
    sleep = RecordingSleep()
    groq = {
        "error": {
            "message": "Tool call validation failed: parameters for tool read_file did not match",
            "type": "invalid_request_error",
            "code": "tool_use_failed",
        }
    }
    server.enqueue(sse_reply("event: error\n" + f"data: {json.dumps(groq)}\n\n"))
    err, _ = expect(AgentBadRequestError, ask(server.base_url, sleep=sleep, max_retries=3))
    assert isinstance(err, AgentBadRequestError)
    assert err.status_code == 400
    assert "Tool call validation failed" in str(err)
    assert sleep.delays == []


def test_a_mid_stream_rate_limit_keeps_retry_after(server: FakeOpenAIServer) -> None:
    server.enqueue(sse_reply({"error": {"message": "slow down", "code": "rate_limit_exceeded"}}))
    err, _ = expect(AgentRateLimitError, ask(server.base_url))
    assert "rate limiting requests (429): slow down" in str(err)


def test_an_error_status_to_a_streaming_request_is_mapped_as_ever(server: FakeOpenAIServer) -> None:
    server.enqueue(reply_from_spec({"status": 503}))
    expect(AgentServerError, ask(server.base_url))


# --- bad streams: one fallback per model -------------------------------------------------------

BAD_STREAMS = [
    pytest.param(sse_reply("data: {not json\n\n"), "an event's data is not JSON", id="not-json"),
    pytest.param(
        sse_reply('{"choices": []}\n', done=False), "not a server-sent event line", id="ndjson"
    ),
    pytest.param(sse_reply("data: [1]\n\n"), "a JSON array, not an object", id="json-array"),
    pytest.param(sse_reply({"choices": "none"}), "choices are not a list", id="choices-text"),
    pytest.param(sse_reply(), "the stream carried no answer", id="empty"),
]


@pytest.mark.parametrize(("bad", "reason"), BAD_STREAMS)
def test_a_bad_stream_falls_back_once(
    server: FakeOpenAIServer, caplog: pytest.LogCaptureFixture, bad: Any, reason: str
) -> None:
    server.enqueue(bad, text_reply("plain one"), text_reply("plain two"))

    async def two_calls() -> list[str]:
        async with HttpChatModel(settings_for(server.base_url)) as model:
            first = await model.complete(HELLO, [])
            second = await model.complete(HELLO, [])
            return [first.message.content, second.message.content]

    with caplog.at_level(logging.WARNING, logger="fsm_kernel.agent.client"):
        answers, seen = watch(two_calls())
    assert answers == ["plain one", "plain two"]
    streamed_requests = ["stream" in r for r in server.requests]
    assert streamed_requests == [True, False, False]  # the second call does not try again
    (notice,) = notices(seen)
    assert notice.kind == "stream_fallback"
    assert reason in notice.detail["reason"]
    assert texts(seen) == ["plain one", "plain two"]
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "streams badly" in warning.getMessage()
    assert reason in warning.getMessage()
    server.assert_complete()


def test_a_new_model_streams_again(server: FakeOpenAIServer) -> None:
    server.enqueue(sse_reply("data: nope\n\n"), text_reply("a"), text_reply("b"))
    watch(ask(server.base_url))
    watch(ask(server.base_url))
    assert ["stream" in r for r in server.requests] == [True, False, True]


# --- the deadline and the size cap hold for streams ------------------------------------------


def test_a_trickling_stream_hits_the_deadline(server: FakeOpenAIServer) -> None:
    # Each event comes well within httpx's per-read timeout; only the deadline ends this.
    server.enqueue(streamed(text_reply("x" * 100), StreamStyle(text_piece=1, interval=0.1)))
    started = time.monotonic()
    err, seen = expect(AgentTimeoutError, ask(server.base_url, request_timeout=0.5))
    assert time.monotonic() - started < 5.0  # the whole stream would take 10 s
    assert err.retryable
    assert 0 < len(texts(seen)) < 100  # some text arrived before the deadline


def test_a_byte_trickled_stream_within_the_deadline(server: FakeOpenAIServer) -> None:
    server.enqueue(trickle(streamed(text_reply("ok"), StreamStyle(usage="none")), interval=0.0005))
    completion, seen = watch(ask(server.base_url, request_timeout=30))
    assert completion.message.content == "ok"
    assert "".join(texts(seen)) == "ok"


def test_a_stream_over_the_size_cap_is_cut(server: FakeOpenAIServer) -> None:
    sleep = RecordingSleep()
    server.enqueue(streamed(text_reply("y" * 5000), StreamStyle(text_piece=10)))
    err, _ = expect(
        AgentResponseError,
        ask(server.base_url, sleep=sleep, max_retries=3, max_response_bytes=2000),
    )
    assert str(err) == (
        f"model server at {server.base_url} sent more than 2000 bytes; "
        "raise --max-response-bytes or FSM_KERNEL_MAX_RESPONSE_BYTES to accept bigger answers"
    )
    assert len(server.requests) == 1
    assert sleep.delays == []


def test_a_stream_exactly_at_the_cap_is_accepted(server: FakeOpenAIServer) -> None:
    reply = sse_reply(chunk(content="fits", finish_reason="stop"))
    size = sum(len(event) for event in reply.events or ())
    server.enqueue(reply, reply)
    assert watch(ask(server.base_url, max_response_bytes=size))[0].message.content == "fits"
    expect(AgentResponseError, ask(server.base_url, max_response_bytes=size - 1))


# --- the fake server's stream specs (script mode) ----------------------------------------------


def test_fake_server_stream_specs() -> None:
    styled = reply_from_spec({"stream": {"text_piece": 1, "crlf": True}, "then": "hi"})
    assert styled.stream_style == StreamStyle(text_piece=1, crlf=True)
    raw = reply_from_spec({"sse": [{"choices": []}, ": ping\n\n"], "done": False})
    assert raw.events == (b'data: {"choices": []}\n\n', b": ping\n\n")


@pytest.mark.parametrize(
    "refusal",
    [
        "Unrecognized request argument supplied: stream_options",
        "streaming is not supported by this deployment",
    ],
)
def test_a_server_that_refuses_streamed_requests_is_asked_without_streaming(
    server: FakeOpenAIServer, refusal: str
) -> None:
    def picky(request: dict[str, Any]) -> Any:
        if "stream" in request or "stream_options" in request:
            return http_error(400, {"error": {"message": refusal, "type": "invalid_request"}})
        return text_reply("plain")

    server.enqueue(picky, picky, picky)

    async def two_calls() -> list[str]:
        async with HttpChatModel(settings_for(server.base_url)) as model:
            first = await model.complete(HELLO, [])
            second = await model.complete(HELLO, [])
            return [first.message.content, second.message.content]

    answers, seen = watch(two_calls())

    assert answers == ["plain", "plain"]
    assert ["stream" in r for r in server.requests] == [True, False, False]
    (notice,) = notices(seen)
    assert notice.kind == "stream_fallback"
    assert refusal in notice.detail["reason"]


def test_another_bad_request_to_a_streamed_request_is_not_a_stream_refusal(
    server: FakeOpenAIServer,
) -> None:
    server.enqueue(http_error(400, {"error": {"message": "model 'x' not found"}}))
    expect(AgentBadRequestError, ask(server.base_url))
    assert len(server.requests) == 1
