"""fsm_kernel.agent.wire's streaming half: SseDecoder (bytes -> events), chunk_from_sse (event ->
chunk) and StreamAssembler (chunks -> the body of an unstreamed answer), with the quirks of
OpenAI, Ollama, vLLM and llama.cpp streams. Pure: no sockets."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from fsm_kernel.agent.wire import (
    SseDecoder,
    SseEvent,
    StreamAssembler,
    StreamFormatError,
    StreamServerError,
    chunk_from_sse,
    completion_from_wire,
)
from fsm_kernel.errors import AgentResponseError
from fsm_kernel.protocol import Completion, Usage
from tests.fakes.openai_server import (
    OLLAMA_STYLE,
    StreamStyle,
    call,
    completion_chunks,
    text_reply,
    tool_reply,
)


def counter_ids() -> Any:
    numbers = itertools.count(1)
    return lambda: f"gen{next(numbers)}"


def assemble(*chunks: Any) -> tuple[StreamAssembler, str]:
    """The assembler after `chunks`, and the text it gave to show (end() included)."""
    assembler = StreamAssembler()
    shown = "".join(assembler.add(c) for c in chunks)
    return assembler, shown + assembler.end()


def completion_of(*chunks: Any) -> Completion:
    assembler, _ = assemble(*chunks)
    return completion_from_wire(assembler.body(), id_factory=counter_ids())


def delta(finish_reason: Any = None, **fields: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": finish_reason}]}


def tool_delta(*entries: dict[str, Any], finish_reason: Any = None) -> dict[str, Any]:
    return delta(finish_reason, tool_calls=list(entries))


def decode(*pieces: bytes) -> list[SseEvent]:
    decoder = SseDecoder()
    events = [e for piece in pieces for e in decoder.feed(piece)]
    return events + decoder.close()


# --- SseDecoder ------------------------------------------------------------------------------

STREAM = b'data: {"a": 1}\n\n: ping\n\nevent: error\ndata: {"b":\ndata: 2}\nid: 7\nretry: 10\n\n'
EXPECTED = [SseEvent('{"a": 1}'), SseEvent('{"b":\n2}', "error")]


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
def test_sse_events_with_any_line_ending(newline: bytes) -> None:
    assert decode(STREAM.replace(b"\n", newline)) == EXPECTED


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
def test_sse_fed_one_byte_at_a_time(newline: bytes) -> None:
    # A CRLF split between two pieces must not count as two line ends (an empty line between).
    stream = STREAM.replace(b"\n", newline)
    assert decode(*(stream[i : i + 1] for i in range(len(stream)))) == EXPECTED


def test_sse_events_are_given_as_soon_as_they_are_complete() -> None:
    decoder = SseDecoder()
    assert decoder.feed(b"data: one\n") == []
    assert decoder.feed(b"\ndata: tw") == [SseEvent("one")]
    assert decoder.feed(b"o\n\n") == [SseEvent("two")]
    assert decoder.close() == []


def test_sse_last_event_without_its_blank_line_or_newline() -> None:
    assert decode(b"data: [DONE]") == [SseEvent("[DONE]")]
    assert decode(b"data: x\n") == [SseEvent("x")]


def test_sse_field_forms() -> None:
    # No space after the colon, a bare "data" line, a BOM at the start, unknown fields.
    events = decode(b"\xef\xbb\xbfdata:tight\n\ndata\n\nfoo: bar\ndata: x\n\n")
    assert events == [SseEvent("tight"), SseEvent(""), SseEvent("x")]


def test_sse_comments_and_blank_lines_alone_give_nothing() -> None:
    assert decode(b": keep-alive\n\n\n\n:\n") == []


@pytest.mark.parametrize(
    "stream",
    [
        b'{"choices": []}\n',  # NDJSON (Ollama's native API)
        b"<html><body>Bad Gateway</body></html>\n",
        b"data: ok\n\n\xff\xfe\n",
    ],
    ids=["ndjson", "html", "not-utf8"],
)
def test_what_is_not_sse_is_refused(stream: bytes) -> None:
    with pytest.raises(StreamFormatError):
        decode(stream)


# --- chunk_from_sse --------------------------------------------------------------------------


def test_chunk_from_sse() -> None:
    assert chunk_from_sse(SseEvent('{"choices": []}')) == {"choices": []}
    assert chunk_from_sse(SseEvent(" [DONE] ")) is None
    assert SseEvent("[DONE]").is_done
    assert chunk_from_sse(SseEvent("  ")) is None


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("not json", "an event's data is not JSON: 'not json'"),
        ("[1, 2]", "an event's data is a JSON array, not an object"),
        ('"text"', "an event's data is a JSON string, not an object"),
    ],
)
def test_chunk_from_sse_refuses_what_is_not_a_json_object(data: str, message: str) -> None:
    with pytest.raises(StreamFormatError) as info:
        chunk_from_sse(SseEvent(data))
    assert str(info.value) == message


def test_an_error_event_is_an_error_chunk_whatever_its_data() -> None:
    groq = '{"error": {"message": "Tool call validation failed", "code": "tool_use_failed"}}'
    assert chunk_from_sse(SseEvent(groq, "error")) == json.loads(groq)
    assert chunk_from_sse(SseEvent("overloaded", "error")) == {"error": {"message": "overloaded"}}
    assert chunk_from_sse(SseEvent('{"message": "m"}', "error")) == {"error": {"message": "m"}}


# --- StreamAssembler: the same Completion as the unstreamed answer ----------------------------

ROUND_TRIPS = [
    pytest.param(text_reply("Hello, streaming world!"), id="text"),
    pytest.param(text_reply("4", reasoning="2 + 2 is 4"), id="reasoning-field"),
    pytest.param(text_reply("<think>hmm, let me see</think>\n\nhello"), id="think-in-content"),
    pytest.param(tool_reply(call("read_file", {"path": "a.txt"}, id="c1")), id="one-call"),
    pytest.param(
        tool_reply(
            call("read_file", {"path": "a"}, id="c1"),
            call("read_file", {"path": "b"}, id="c2"),
            call("now", {}, id="c3"),
            content="Reading both.",
        ),
        id="parallel-calls-and-text",
    ),
    pytest.param(tool_reply(call("t", "{bad json", id="c1")), id="invalid-arguments"),
    pytest.param(text_reply("no finish", finish_reason=None), id="null-finish"),
]
STYLES = [
    pytest.param(StreamStyle(), id="openai"),
    pytest.param(StreamStyle(text_piece=1, args_piece=1), id="openai-1-char"),
    pytest.param(OLLAMA_STYLE, id="ollama"),
    pytest.param(StreamStyle(args_piece=0, call_index="none"), id="whole-calls-no-index"),
    pytest.param(StreamStyle(usage="finish", finish_reason=False), id="usage-on-finish"),
]


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("reply", ROUND_TRIPS)
def test_streamed_and_unstreamed_answers_normalise_alike(reply: Any, style: StreamStyle) -> None:
    body = {**reply.body, "model": "m", "id": "chatcmpl-1"}
    streamed = completion_of(*completion_chunks(body, style))
    assert streamed == completion_from_wire(body, id_factory=counter_ids())


def test_openai_chunks_from_the_cassette() -> None:
    head = {"id": "chatcmpl-Dx0Xp", "object": "chat.completion.chunk", "model": "gpt-4o-mini"}
    first = {
        "index": 0,
        "id": "call_ZR5UUuTt3pf61kjwAJIYdVMj",
        "type": "function",
        "function": {"name": "get_capital", "arguments": ""},
    }
    chunks = [
        {**head, **delta(role="assistant", content=None, tool_calls=[first], refusal=None)},
        *(
            {**head, **tool_delta({"index": 0, "function": {"arguments": piece}}), "usage": None}
            for piece in ['{"', "country", '":"', "UK", '"}']
        ),
        {**head, **delta("tool_calls"), "usage": None, "obfuscation": "C63r"},
        {**head, "choices": [], "usage": {"prompt_tokens": 53, "completion_tokens": 15}},
    ]
    completion = completion_of(*chunks)
    (tc,) = completion.message.tool_calls
    assert (tc.id, tc.name, tc.arguments) == (
        "call_ZR5UUuTt3pf61kjwAJIYdVMj",
        "get_capital",
        {"country": "UK"},
    )
    assert completion.finish_reason == "tool_calls"
    assert completion.usage == Usage(prompt_tokens=53, completion_tokens=15, total_tokens=68)
    assert completion.model == "gpt-4o-mini"


# --- tool-call quirks ------------------------------------------------------------------------


def whole(name: str, arguments: Any, **keys: Any) -> dict[str, Any]:
    return {**keys, "function": {"name": name, "arguments": arguments}}


def calls_of(*chunks: Any) -> list[tuple[str, str, Any]]:
    return [(c.id, c.name, c.arguments) for c in completion_of(*chunks).message.tool_calls]


def test_ollama_calls_all_at_index_0_are_told_apart_by_id() -> None:
    assert calls_of(
        tool_delta(whole("a", '{"x": 1}', index=0, id="call_1")),
        tool_delta(whole("b", '{"y": 2}', index=0, id="call_2")),
        delta("tool_calls"),
    ) == [("call_1", "a", {"x": 1}), ("call_2", "b", {"y": 2})]


def test_ollama_calls_at_index_0_without_ids_are_told_apart_when_complete() -> None:
    assert calls_of(
        tool_delta(whole("a", '{"x": 1}', index=0)),
        tool_delta(whole("a", '{"x": 2}', index=0)),
    ) == [("gen1", "a", {"x": 1}), ("gen2", "a", {"x": 2})]


def test_calls_without_index_keyed_by_id_or_by_name() -> None:
    assert calls_of(
        tool_delta(whole("a", '{"x"', id="c1")),
        tool_delta({"id": "c1", "function": {"arguments": ": 1}"}}),
        tool_delta(whole("b", "{}", id="c2")),
        tool_delta(whole("c", '{"z":')),
        tool_delta({"function": {"arguments": " 3}"}}),  # anonymous: continues the last call
    ) == [("c1", "a", {"x": 1}), ("c2", "b", {}), ("gen1", "c", {"z": 3})]


def test_vllm_name_resent_with_every_fragment_is_kept_once() -> None:
    assert calls_of(
        tool_delta(whole("get", "", index=0, id="chatcmpl-tool-1")),
        tool_delta(whole("get", '{"q": ', index=0)),
        tool_delta(whole("get", '"x"}', index=0)),
        tool_delta(whole("get", "", index=0)),
    ) == [("chatcmpl-tool-1", "get", {"q": "x"})]


def test_later_ids_on_a_fragment_do_not_replace_the_first() -> None:
    assert calls_of(
        tool_delta(whole("a", '{"x":', index=0, id="call_1")),
        tool_delta({"index": 0, "id": "call_1", "function": {"arguments": " 1}"}}),
    ) == [("call_1", "a", {"x": 1})]


def test_missing_ids_are_synthesised_unique() -> None:
    calls = calls_of(
        tool_delta(whole("a", "{}", index=0), whole("b", "{}", index=1, id="")),
        tool_delta(whole("c", "{}", index=2, id=None)),
    )
    assert [c[0] for c in calls] == ["gen1", "gen2", "gen3"]


def test_arguments_as_an_object_and_the_parameters_alias() -> None:
    assert calls_of(
        tool_delta(whole("a", {"x": 1}, index=0, id="c1")),
        tool_delta({"index": 1, "id": "c2", "function": {"name": "b", "parameters": '{"y": 2}'}}),
        tool_delta({"index": 2, "id": "c3", "name": "c", "arguments": "{}"}),  # no wrapper
    ) == [("c1", "a", {"x": 1}), ("c2", "b", {"y": 2}), ("c3", "c", {})]


def test_interleaved_fragments_of_parallel_calls() -> None:
    assert calls_of(
        tool_delta(whole("a", "", index=0, id="c1"), whole("b", "", index=1, id="c2")),
        tool_delta({"index": 1, "function": {"arguments": '{"b": 2}'}}),
        tool_delta({"index": 0, "function": {"arguments": '{"a": 1}'}}),
    ) == [("c1", "a", {"a": 1}), ("c2", "b", {"b": 2})]


def test_bad_arguments_are_kept_raw_as_unstreamed() -> None:
    (tc,) = completion_of(tool_delta(whole("a", "{oops", index=0, id="c1"))).message.tool_calls
    assert tc.raw_arguments == "{oops"
    assert tc.arguments_error is not None


# --- text, reasoning, finish, usage ------------------------------------------------------------


def test_add_gives_the_answer_text_to_show() -> None:
    assembler = StreamAssembler()
    shown = [
        assembler.add(delta(role="assistant", content="")),
        assembler.add(delta(content="Hel")),
        assembler.add(delta(content="lo")),
        assembler.add(delta("stop")),
    ]
    assert shown == ["", "Hel", "lo", ""]
    assert assembler.finished


def test_reasoning_deltas_are_never_shown_and_are_kept() -> None:
    assembler, shown = assemble(
        delta(role="assistant", reasoning_content="think"),
        delta(reasoning_content="ing"),
        delta(content="answer"),
        delta("stop"),
    )
    assert shown == "answer"
    completion = completion_from_wire(assembler.body())
    assert (completion.message.content, completion.message.reasoning) == ("answer", "thinking")


def test_both_reasoning_fields_are_not_doubled() -> None:
    # vLLM's move from reasoning_content to reasoning: some builds send both.
    completion = completion_of(
        delta(reasoning_content="hmm", reasoning="hmm"), delta("stop", content="ok")
    )
    assert completion.message.reasoning == "hmm"


def test_think_blocks_are_not_shown_even_split_across_deltas() -> None:
    pieces = ["<th", "ink>I sh", "ould greet</thi", "nk>\n\nHel", "lo <", "b>!"]
    assembler, shown = assemble(*(delta(content=p) for p in pieces), delta("stop"))
    assert shown == "Hello <b>!"
    completion = completion_from_wire(assembler.body())
    assert (completion.message.content, completion.message.reasoning) == (
        "Hello <b>!",
        "I should greet",
    )


def test_text_that_only_looked_like_a_tag_is_shown_at_the_end() -> None:
    assembler = StreamAssembler()
    assert assembler.add(delta(content="a <thi")) == "a "
    assert assembler.end() == "<thi"


def test_an_unclosed_think_block_shows_nothing() -> None:
    _, shown = assemble(delta(content="<think>cut off while thinking"))
    assert shown == ""


@pytest.mark.parametrize(
    ("chunks", "usage"),
    [
        pytest.param(
            [delta("stop", content="x"), {"choices": [], "usage": {"prompt_tokens": 3}}],
            Usage(prompt_tokens=3, total_tokens=3),
            id="usage-only-final-chunk",
        ),
        pytest.param(
            [{**delta("stop", content="x"), "usage": {"completion_tokens": 2}}],
            Usage(completion_tokens=2, total_tokens=2),
            id="usage-on-the-finish-chunk",
        ),
        pytest.param(
            [{**delta(content="x"), "usage": None}, delta("stop")], Usage(), id="no-usage"
        ),
    ],
)
def test_usage(chunks: list[Any], usage: Usage) -> None:
    assert completion_of(*chunks).usage == usage


@pytest.mark.parametrize(
    ("chunks", "reason"),
    [
        ([delta(content="hi"), delta(None)], "stop"),
        ([tool_delta(whole("a", "{}", index=0)), delta(None)], "tool_calls"),
        ([tool_delta(whole("a", "{}", index=0)), delta("stop")], "tool_calls"),
        ([delta("length", content="cut")], "length"),
        ([delta(content="x"), delta("end_turn")], "stop"),
    ],
    ids=["null-text", "null-calls", "stop-with-calls", "length", "foreign"],
)
def test_finish_reasons_normalise_as_unstreamed(chunks: list[Any], reason: str) -> None:
    assert completion_of(*chunks).finish_reason == reason


def test_not_finished_until_a_finish_reason() -> None:
    assembler, _ = assemble(delta(content="x"), delta(None))
    assert not assembler.finished


def test_refusal_deltas_become_content_filter() -> None:
    completion = completion_of(delta(refusal="I can't"), delta(refusal=" help."), delta("stop"))
    assert (completion.message.content, completion.finish_reason) == (
        "I can't help.",
        "content_filter",
    )


def test_only_the_first_choice_counts_and_message_stands_for_delta() -> None:
    chunks = [
        {"choices": [{"index": 1, "delta": {"content": "other"}}]},
        {"choices": [{"message": {"content": "whole"}, "finish_reason": "stop"}]},
    ]
    assert completion_of(*chunks).message.content == "whole"


def test_a_stream_without_choices_has_no_answer() -> None:
    assembler, _ = assemble({"choices": [], "usage": {"prompt_tokens": 1}})
    assert assembler.body()["choices"] == []
    with pytest.raises(AgentResponseError, match="response has no choices"):
        completion_from_wire(assembler.body())


# --- errors and bad shapes ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "status"),
    [
        ({"message": "overloaded", "type": "server_error", "code": None}, 500),
        ({"message": "slow down", "code": "rate_limit_exceeded"}, 429),
        ({"message": "quota", "type": "insufficient_quota"}, 429),
        ({"message": "bad call", "type": "invalid_request_error", "code": "tool_use_failed"}, 400),
        ({"message": "no such model", "code": "model_not_found"}, 404),
        ({"message": "key", "code": "invalid_api_key"}, 401),
        ({"message": "llama.cpp", "code": 503, "type": "unavailable_error"}, 503),
        ({"message": "vllm", "code": "429"}, 429),
        ({"message": "odd", "code": 7}, 500),
        ("model does not support tools", 500),
    ],
)
def test_an_error_chunk_raises_with_the_status_it_stands_for(error: Any, status: int) -> None:
    assembler = StreamAssembler()
    assembler.add(delta(content="partial"))
    with pytest.raises(StreamServerError) as info:
        assembler.add({"error": error})
    assert info.value.status == status
    assert info.value.body == {"error": error}


@pytest.mark.parametrize(
    "chunk",
    [
        [1, 2],
        {"choices": {"index": 0}},
        {"choices": ["x"]},
        {"choices": [{"index": 0, "delta": "text"}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": "call"}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [3]}}]},
    ],
    ids=["array", "choices-object", "choice-text", "delta-text", "calls-text", "call-number"],
)
def test_chunks_of_the_wrong_shape_are_a_format_error(chunk: Any) -> None:
    with pytest.raises(StreamFormatError):
        StreamAssembler().add(chunk)


def test_a_chunk_without_choices_or_with_a_null_delta_adds_nothing() -> None:
    assembler, shown = assemble(
        {"id": "x", "object": "chat.completion.chunk"},
        {"choices": [{"index": 0, "delta": None, "finish_reason": "stop"}]},
    )
    assert shown == ""
    assert completion_from_wire(assembler.body()).message.content == ""


@pytest.mark.parametrize("whole", [True, False], ids=["one delta (Ollama)", "fragments (OpenAI)"])
def test_streamed_arguments_nested_5000_deep_are_a_malformed_call(whole: bool) -> None:
    deep = '{"a":' * 5_000 + "1" + "}" * 5_000
    fn = {"name": "f", "arguments": deep}
    chunk = {
        "choices": [
            {"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c1", "function": fn}]}}
        ]
    }
    data = json.dumps(chunk)
    if whole:  # the arguments as an object: the chunk itself is 5,000 deep
        data = data.replace(json.dumps(deep), deep)
    assembler = StreamAssembler()

    assembler.add(chunk_from_sse(SseEvent(data)))
    assembler.add({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})

    (call,) = completion_from_wire(assembler.body()).message.tool_calls
    assert (call.id, call.name, call.arguments) == ("c1", "f", {})
    assert call.arguments_error == "arguments nest objects and arrays deeper than 100 levels"
