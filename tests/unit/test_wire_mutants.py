"""Wire-format behaviours that mutation testing found unpinned: the one-line text of a server's
error (cut at 200 characters, non-ASCII kept), how a malformed tool call names the JSON type it
got, the canonical form kept of arguments that are not an object, JSON read within bounds at its
exact depth and on a deep stack, the HTTP status an in-stream error stands for, and the
`parameters` alias when Ollama sends whole calls at one index."""

from __future__ import annotations

import inspect
import itertools
import json
import sys
from collections.abc import Callable
from typing import Any

import pytest

from fsm_kernel.agent.wire import (
    StreamAssembler,
    StreamServerError,
    completion_from_wire,
    loads_json,
    messages_from_wire,
    messages_with_instructions,
)
from fsm_kernel.errors import AgentResponseError
from fsm_kernel.protocol import Message, ToolCall


def counter_ids() -> Callable[[], str]:
    numbers = itertools.count(1)
    return lambda: f"gen{next(numbers)}"


def refusal_of(body: Any) -> str:
    with pytest.raises(AgentResponseError) as caught:
        completion_from_wire(body)
    return str(caught.value)


def test_instructions_become_the_first_message_when_there_is_no_system_message() -> None:
    assert messages_with_instructions([Message.user("hi")], "be brief") == [
        Message.system("be brief"),
        Message.user("hi"),
    ]


def test_a_servers_error_is_quoted_on_one_line_cut_at_200_characters() -> None:
    prefix = "response carries an error: "
    whole = "x" * 200
    assert refusal_of({"error": {"message": whole}}) == prefix + whole
    assert refusal_of({"error": {"message": whole + "y"}}) == prefix + "x" * 199 + "…"
    assert refusal_of({"error": "  two\n lines "}) == prefix + "two lines"
    # an error without a message is quoted as its JSON, non-ASCII as it is
    assert refusal_of({"error": {"code": "délai", "n": 1}}) == prefix + '{"code": "délai", "n": 1}'


def test_parsing_a_requests_messages_uses_the_given_id_factory() -> None:
    wire = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]

    [message] = messages_from_wire(wire, id_factory=counter_ids())

    assert [c.id for c in message.tool_calls] == ["gen1"]


def test_malformed_tool_calls_name_the_json_type_and_keep_canonical_arguments() -> None:
    """Arguments that are not an object are kept as canonical JSON (sorted keys, non-ASCII as
    it is), the form ToolCall.arguments_json() writes, so the call round-trips."""
    body = {
        "choices": [
            {
                "message": {
                    "tool_calls": [
                        None,
                        {"function": {"name": "f", "arguments": [{"b": 1, "a": "é"}]}},
                        {"function": {"arguments": {"b": 1, "a": "é"}}},
                        {"function": {"name": "g", "arguments": "true"}},
                    ]
                }
            }
        ]
    }

    calls = completion_from_wire(body, id_factory=counter_ids()).message.tool_calls

    assert list(calls) == [
        ToolCall(
            id="gen1",
            name="",
            raw_arguments="null",
            arguments_error="the tool call is a JSON null, not an object",
        ),
        ToolCall(
            id="gen2",
            name="f",
            raw_arguments='[{"a": "é", "b": 1}]',
            arguments_error="arguments are a JSON array, not an object",
        ),
        ToolCall(
            id="gen3",
            name="",
            arguments={"b": 1, "a": "é"},
            raw_arguments='{"a": "é", "b": 1}',
            arguments_error="the tool call has no name",
        ),
        ToolCall(
            id="gen4",
            name="g",
            raw_arguments="true",
            arguments_error="arguments are a JSON boolean, not an object",
        ),
    ]


def nesting(value: Any) -> tuple[int, Any]:
    """How many lists deep `value` goes (first elements), and what is at the bottom."""
    depth = 0
    while isinstance(value, list) and value:
        value, depth = value[0], depth + 1
    return depth, value


def test_json_nested_past_200_levels_is_read_as_null_from_the_201st() -> None:
    assert nesting(loads_json("[" * 200 + "1" + "]" * 200)) == (200, 1)
    assert nesting(loads_json("[" * 201 + "1" + "]" * 201)) == (200, None)


def with_little_stack(fn: Callable[[], Any], room: int = 120) -> Any:
    """`fn()` called with only about `room` frames of recursion left."""

    def descend(n: int) -> Any:
        return fn() if n <= 0 else descend(n - 1)

    return descend(sys.getrecursionlimit() - len(inspect.stack(0)) - room)


@pytest.mark.parametrize("depth", [150, 300])
def test_json_read_on_a_deep_stack_fails_as_not_json_not_with_recursion_error(depth: int) -> None:
    text = "[" * depth + "]" * depth

    with pytest.raises(json.JSONDecodeError) as caught:
        with_little_stack(lambda: loads_json(text))

    assert str(caught.value) == "nested too deeply: line 1 column 1 (char 0)"


@pytest.mark.parametrize(
    ("error", "status"),
    [
        ({"status": 503}, 503),
        ({"status_code": "429"}, 429),
        ({"code": 400}, 400),
        ({"code": 599}, 599),
        ({"code": 600}, 500),
        ({"code": 399}, 500),
        ({"code": None, "type": "rate_limit_exceeded"}, 429),
        ("overloaded", 500),
    ],
)
def test_an_in_stream_error_stands_for_the_http_status_it_names(error: Any, status: int) -> None:
    raised = StreamServerError({"error": error})
    assert raised.status == status


def test_an_in_stream_error_reads_as_its_message_or_the_whole_chunk() -> None:
    assert str(StreamServerError({"error": {"message": "model overloaded"}})) == (
        "model overloaded"
    )
    bare = StreamServerError({"detail": "no", "code": 429})  # no `error` key: the chunk is it
    assert (str(bare), bare.status) == ('{"detail": "no", "code": 429}', 429)


def test_whole_calls_at_one_index_with_parameters_start_a_new_call_each() -> None:
    """Ollama sends each call whole at index 0, without ids; some models say `parameters`."""
    assembler = StreamAssembler()
    for name, params in (("a", {"x": 1}), ("b", {"y": 2})):
        entry = {"index": 0, "function": {"name": name, "parameters": params}}
        assembler.add({"choices": [{"index": 0, "delta": {"tool_calls": [entry]}}]})

    calls = completion_from_wire(assembler.body(), id_factory=counter_ids()).message.tool_calls

    assert [(c.name, c.arguments) for c in calls] == [("a", {"x": 1}), ("b", {"y": 2})]


def test_a_new_id_at_the_same_index_starts_a_new_call_before_its_arguments_arrive() -> None:
    """Ollama sends every call at index 0: a delta with a new id and a name is the next call,
    even when its arguments come in a later fragment."""
    assembler = StreamAssembler()
    for entry in (
        {"index": 0, "id": "a", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"index": 0, "id": "b", "function": {"name": "g"}},
        {"index": 0, "function": {"arguments": '{"y": 2}'}},
    ):
        assembler.add({"choices": [{"index": 0, "delta": {"tool_calls": [entry]}}]})

    calls = completion_from_wire(assembler.body()).message.tool_calls

    assert [(c.id, c.name, c.arguments) for c in calls] == [
        ("a", "f", {"x": 1}),
        ("b", "g", {"y": 2}),
    ]


def test_a_tool_call_that_is_a_string_keeps_it_as_json_text() -> None:
    body = {"choices": [{"message": {"tool_calls": ["héllo"]}}]}

    [bad] = completion_from_wire(body, id_factory=counter_ids()).message.tool_calls

    assert (bad.raw_arguments, bad.arguments_error) == (
        '"héllo"',
        "the tool call is a JSON string, not an object",
    )


def test_ids_that_cannot_be_made_unique_are_refused() -> None:
    repeated = {"id": "x", "function": {"name": "f", "arguments": "{}"}}
    body = {"choices": [{"message": {"tool_calls": [repeated, repeated]}}]}

    with pytest.raises(AgentResponseError) as caught:
        completion_from_wire(body, id_factory=lambda: "x")

    assert str(caught.value) == "could not synthesise a unique tool-call id"
