"""fsm_kernel.agent.wire: protocol <-> chat-completions JSON, and every server quirk it absorbs."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

import pytest

from fsm_kernel.agent.wire import (
    MAX_JSON_DEPTH,
    completion_from_wire,
    loads_json,
    message_from_wire,
    messages_from_wire,
    messages_to_wire,
    new_call_id,
    tools_to_wire,
)
from fsm_kernel.errors import AgentResponseError
from fsm_kernel.protocol import Message, Role, Tool, ToolCall, ToolResult, Usage


def body(message: dict[str, Any], finish_reason: Any = "stop", **extra: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "message": message, "finish_reason": finish_reason}], **extra}


def wire_call(name: str, arguments: Any, id: Any = "call_1") -> dict[str, Any]:
    return {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}


def counter_ids() -> Any:
    numbers = itertools.count(1)
    return lambda: f"gen{next(numbers)}"


# --- protocol -> wire -----------------------------------------------------------------------


def test_messages_to_wire_shapes() -> None:
    tc = ToolCall(id="c1", name="read_file", arguments={"path": "a.txt", "n": 2})
    messages = [
        Message.system("be careful"),
        Message.user("read a.txt"),
        Message.assistant("", [tc]),
        Message.tool(tc, ToolResult(content="hello")),
        Message.assistant("it says hello"),
    ]
    assert messages_to_wire(messages) == [
        {"role": "system", "content": "be careful"},
        {"role": "user", "content": "read a.txt"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": '{"n": 2, "path": "a.txt"}'},
                }
            ],
        },
        {"role": "tool", "content": "hello", "tool_call_id": "c1", "name": "read_file"},
        {"role": "assistant", "content": "it says hello"},
    ]


def test_assistant_tool_turn_is_sent_with_empty_string_content_not_null() -> None:
    tc = ToolCall(id="c1", name="t")
    (wire,) = messages_to_wire([Message.assistant(tool_calls=[tc])])
    assert wire["content"] == ""
    assert json.loads(json.dumps(wire))["content"] is not None


def test_reasoning_is_never_sent_back() -> None:
    msg = Message(role=Role.ASSISTANT, content="42", reasoning="let me think")
    wire = messages_to_wire([msg])
    assert wire == [{"role": "assistant", "content": "42"}]
    assert "let me think" not in json.dumps(wire)


def test_invalid_arguments_are_echoed_verbatim() -> None:
    tc = ToolCall(id="c1", name="t", raw_arguments="{oops", arguments_error="bad")
    (wire,) = messages_to_wire([Message.assistant(tool_calls=[tc])])
    assert wire["tool_calls"][0]["function"]["arguments"] == "{oops"


def test_tools_to_wire() -> None:
    schema = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
    tools = [Tool(name="read_file", description="Read a file", parameters=schema)]
    assert tools_to_wire(tools) == [
        {
            "type": "function",
            "function": {"name": "read_file", "description": "Read a file", "parameters": schema},
        }
    ]
    assert tools_to_wire([]) == []


# --- round trip ------------------------------------------------------------------------------


ROUND_TRIP_CALLS = [
    ToolCall(id="c1", name="read_file", arguments={"path": "a.txt"}),
    ToolCall(id="c2", name="search", arguments={"q": "été", "opts": {"limit": 3, "tags": ["x"]}}),
    ToolCall(id="c3", name="now"),
    ToolCall(
        id="c4",
        name="broken",
        raw_arguments='{"path": "a.txt"',
        arguments_error="arguments are not valid JSON: Expecting ',' delimiter at position 16",
    ),
]


def test_round_trip_gives_back_equal_tool_calls() -> None:
    sent = Message.assistant("calling tools", ROUND_TRIP_CALLS)
    (wire,) = messages_to_wire([sent])
    completion = completion_from_wire(body(wire, "tool_calls"))
    assert completion.message.tool_calls == tuple(ROUND_TRIP_CALLS)
    assert completion.message.content == "calling tools"
    assert completion.finish_reason == "tool_calls"


def test_messages_from_wire_round_trips_a_conversation() -> None:
    tc = ToolCall(id="c1", name="t", arguments={"a": [1, 2]})
    conversation = [
        Message.system("s"),
        Message.user("u"),
        Message.assistant("", [tc]),
        Message.tool(tc, ToolResult(content="r")),
        Message.assistant("done"),
    ]
    assert messages_from_wire(messages_to_wire(conversation)) == conversation


def test_messages_from_wire_maps_developer_to_system_and_rejects_unknown_roles() -> None:
    assert message_from_wire({"role": "developer", "content": "x"}) == Message.system("x")
    with pytest.raises(AgentResponseError, match="unknown role 'wizard'"):
        messages_from_wire([{"role": "wizard", "content": "x"}])
    with pytest.raises(AgentResponseError, match="not an object"):
        messages_from_wire(["hello"])


# --- arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ('{"path": "a.txt"}', {"path": "a.txt"}),
        ({"path": "a.txt"}, {"path": "a.txt"}),  # llama.cpp #20198, Ollama native
        ("", {}),
        ("   ", {}),
        (None, {}),
        ("null", {}),
    ],
    ids=["json-string", "object", "empty-string", "blank", "null", "json-null"],
)
def test_arguments_in_every_accepted_form(arguments: Any, expected: dict[str, Any]) -> None:
    completion = completion_from_wire(
        body({"content": None, "tool_calls": [wire_call("t", arguments)]})
    )
    (tc,) = completion.message.tool_calls
    assert tc.arguments == expected
    assert tc.raw_arguments is None
    assert tc.arguments_error is None


def test_arguments_missing_key_and_parameters_alias() -> None:
    no_args = {"id": "a", "type": "function", "function": {"name": "now"}}
    alias = {"id": "b", "function": {"name": "t", "parameters": {"x": 1}}}
    calls = completion_from_wire(body({"tool_calls": [no_args, alias]})).message.tool_calls
    assert [(c.id, c.name, c.arguments) for c in calls] == [("a", "now", {}), ("b", "t", {"x": 1})]


def test_invalid_json_arguments_are_kept_raw_not_raised() -> None:
    raw = '{"path": "a.txt",'
    completion = completion_from_wire(body({"tool_calls": [wire_call("read_file", raw)]}))
    (tc,) = completion.message.tool_calls
    assert tc.name == "read_file"
    assert tc.arguments == {}
    assert tc.raw_arguments == raw
    assert tc.arguments_error is not None
    assert tc.arguments_error.startswith("arguments are not valid JSON")
    assert completion.finish_reason == "tool_calls"


@pytest.mark.parametrize(
    ("arguments", "kind"),
    [("[1, 2]", "array"), ('"text"', "string"), ("5", "number"), ([1, 2], "array")],
)
def test_arguments_that_are_json_but_not_an_object(arguments: Any, kind: str) -> None:
    (tc,) = completion_from_wire(
        body({"tool_calls": [wire_call("t", arguments)]})
    ).message.tool_calls
    assert tc.arguments == {}
    assert tc.arguments_error == f"arguments are a JSON {kind}, not an object"
    assert tc.raw_arguments == (arguments if isinstance(arguments, str) else json.dumps(arguments))


def test_call_without_function_wrapper_and_call_without_name() -> None:
    flat = {"id": "a", "name": "t", "arguments": {"x": 1}}  # stale llama.cpp docs shape
    nameless = {"id": "b", "type": "function", "function": {"arguments": '{"x": 2}'}}
    a, b = completion_from_wire(body({"tool_calls": [flat, nameless]})).message.tool_calls
    assert (a.name, a.arguments, a.arguments_error) == ("t", {"x": 1}, None)
    assert b.name == ""
    assert b.arguments_error == "the tool call has no name"
    assert b.raw_arguments == '{"x": 2}'


def test_tool_call_entry_that_is_not_an_object_becomes_a_malformed_call() -> None:
    (tc,) = completion_from_wire(
        body({"tool_calls": ["t()"]}), id_factory=lambda: "X"
    ).message.tool_calls
    assert tc == ToolCall(
        id="X",
        name="",
        raw_arguments='"t()"',
        arguments_error="the tool call is a JSON string, not an object",
    )


# --- ids -------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad_id", [None, "", "   "], ids=["null", "empty", "blank"])
def test_missing_ids_are_synthesised(bad_id: Any) -> None:
    calls = [wire_call("a", "{}", id=bad_id), {"type": "function", "function": {"name": "b"}}]
    completion = completion_from_wire(body({"tool_calls": calls}), id_factory=counter_ids())
    assert [tc.id for tc in completion.message.tool_calls] == ["gen1", "gen2"]


def test_duplicate_ids_are_made_unique_and_first_keeps_its_id() -> None:
    # Ollama bug: parallel calls all sent with the same id / index.
    calls = [
        wire_call("a", "{}", id="call_0"),
        wire_call("b", "{}", id="call_0"),
        wire_call("c", "{}", id="call_0"),
    ]
    completion = completion_from_wire(body({"tool_calls": calls}), id_factory=counter_ids())
    assert [tc.id for tc in completion.message.tool_calls] == ["call_0", "gen1", "gen2"]


def test_synthesised_id_never_collides_with_a_server_id() -> None:
    factory = iter(["taken", "taken", "fresh"])
    calls = [wire_call("a", "{}", id="taken"), wire_call("b", "{}", id=None)]
    completion = completion_from_wire(body({"tool_calls": calls}), id_factory=lambda: next(factory))
    assert [tc.id for tc in completion.message.tool_calls] == ["taken", "fresh"]


def test_integer_ids_become_strings() -> None:
    completion = completion_from_wire(body({"tool_calls": [wire_call("a", "{}", id=365174485)]}))
    assert completion.message.tool_calls[0].id == "365174485"


def test_default_synthesised_ids_are_nine_alphanumerics_and_unique() -> None:
    calls = [wire_call(f"t{i}", "{}", id="") for i in range(20)]
    ids = [tc.id for tc in completion_from_wire(body({"tool_calls": calls})).message.tool_calls]
    assert len(set(ids)) == 20
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)
    assert re.fullmatch(r"[A-Za-z0-9]{9}", new_call_id())


# --- content, reasoning ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, ""),
        ("", ""),
        ("hello", "hello"),
        ([{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}], "hello"),
        (["hel", "lo"], "hello"),
    ],
    ids=["null", "empty", "string", "parts", "string-parts"],
)
def test_content_forms(content: Any, expected: str) -> None:
    completion = completion_from_wire(body({"role": "assistant", "content": content}))
    assert completion.message.content == expected
    assert completion.message.role is Role.ASSISTANT


def test_absent_content_and_role() -> None:
    completion = completion_from_wire(body({"tool_calls": [wire_call("t", "{}")]}))
    assert completion.message.content == ""
    assert completion.message.role is Role.ASSISTANT


@pytest.mark.parametrize(
    ("content", "answer", "reasoning"),
    [
        ("<think>step 1\nstep 2</think>\n\nThe answer is 4.", "The answer is 4.", "step 1\nstep 2"),
        ("<think>\n\n</think>\n\nHi", "Hi", None),  # Qwen3 with thinking off
        ("forced open</think>Result", "Result", "forced open"),  # missing opening tag
        ("<think>a</think>x<think>b</think>y", "xy", "a\n\nb"),
        ("<think>cut off mid thought", "", "cut off mid thought"),
        ("no thinking here", "no thinking here", None),
    ],
    ids=["block", "empty-block", "no-open-tag", "two-blocks", "unclosed", "none"],
)
def test_think_blocks_move_into_reasoning(content: str, answer: str, reasoning: str | None) -> None:
    message = completion_from_wire(body({"role": "assistant", "content": content})).message
    assert message.content == answer
    assert message.reasoning == reasoning


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content", "thinking"])
def test_reasoning_fields(field: str) -> None:
    message = completion_from_wire(body({"content": "42", field: "because"})).message
    assert (message.content, message.reasoning) == ("42", "because")


def test_reasoning_field_and_think_block_are_both_kept() -> None:
    wire = {"content": "<think>inline</think>ok", "reasoning_content": "field"}
    message = completion_from_wire(body(wire)).message
    assert (message.content, message.reasoning) == ("ok", "field\n\ninline")


def test_reasoning_beside_tool_calls_deepseek_style() -> None:
    wire = {
        "content": "",
        "reasoning_content": "need the file",
        "tool_calls": [wire_call("t", "{}")],
    }
    completion = completion_from_wire(body(wire, "tool_calls"))
    assert completion.message.reasoning == "need the file"
    assert completion.finish_reason == "tool_calls"


def test_leaked_tool_call_markup_is_cut_when_calls_were_parsed() -> None:
    wire = {
        "content": "Let me check.\n<tool_call>\n<function=get_weather",
        "tool_calls": [wire_call("get_weather", "{}")],
    }
    assert completion_from_wire(body(wire)).message.content == "Let me check."


def test_refusal_becomes_content_filter() -> None:
    completion = completion_from_wire(body({"content": None, "refusal": "I can't help"}))
    assert completion.finish_reason == "content_filter"
    assert completion.message.content == "I can't help"


def test_a_refusal_keeps_content_the_server_also_sent() -> None:
    completion = completion_from_wire(body({"content": "Sorry.", "refusal": "policy"}))
    assert completion.finish_reason == "content_filter"
    assert completion.message.content == "Sorry."


def test_an_empty_refusal_is_no_refusal() -> None:
    completion = completion_from_wire(body({"content": "Hello.", "refusal": ""}))
    assert completion.finish_reason == "stop"
    assert completion.message.content == "Hello."


def test_a_refusal_beside_tool_calls_leaves_the_calls_in_charge() -> None:
    message = {"content": None, "refusal": "no", "tool_calls": [wire_call("t", "{}")]}
    completion = completion_from_wire(body(message, "tool_calls"))
    assert completion.finish_reason == "tool_calls"
    assert [c.name for c in completion.message.tool_calls] == ["t"]
    assert completion.message.content == ""


# --- finish_reason ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "has_calls", "expected"),
    [
        ("stop", False, "stop"),
        (None, False, "stop"),  # Ollama
        ("", False, "stop"),
        ("end_turn", False, "stop"),  # LiteLLM Gemini
        ("length", False, "length"),
        ("content_filter", False, "content_filter"),
        ("error", False, "unknown"),  # OpenRouter
        ("something_new", False, "unknown"),
        ("tool_calls", True, "tool_calls"),
        ("stop", True, "tool_calls"),  # vLLM 0.7.3, SGLang
        (None, True, "tool_calls"),
        ("tool", True, "tool_calls"),  # old llama.cpp docs
        ("something_new", True, "tool_calls"),
        ("length", True, "length"),  # cut off: calls must not run
        ("error", True, "unknown"),
        ("tool_calls", False, "stop"),  # vLLM: tool_calls: [] on a plain answer
        ("content_filter", True, "content_filter"),  # filtered: the calls must not run
        (" STOP ", False, "stop"),  # case and spaces are normalised
        ("eos", False, "stop"),
        ("stop_sequence", False, "stop"),
        ("max_tokens", False, "length"),
        ("max_tokens", True, "length"),  # an alias of a cut-off: the calls must not run either
        ("refusal", True, "content_filter"),
        ("refusal", False, "content_filter"),
        ("tool_use", True, "tool_calls"),
        ("tool_use", False, "stop"),
        ("function_call", True, "tool_calls"),
        ("function_call", False, "stop"),
        ("tool", False, "stop"),
    ],
)
def test_finish_reason_normalisation(raw: Any, has_calls: bool, expected: str) -> None:
    message: dict[str, Any] = {"content": "x"}
    message["tool_calls"] = [wire_call("t", "{}")] if has_calls else []
    assert completion_from_wire(body(message, raw)).finish_reason == expected


def test_missing_finish_reason_key() -> None:
    assert (
        completion_from_wire({"choices": [{"message": {"content": "x"}}]}).finish_reason == "stop"
    )


def test_empty_tool_calls_list_is_no_tool_calls() -> None:
    completion = completion_from_wire(body({"content": "hi", "tool_calls": []}))
    assert completion.message.tool_calls == ()


# --- usage, model ----------------------------------------------------------------------------


def test_usage_and_model() -> None:
    usage = {
        "prompt_tokens": 71,
        "completion_tokens": 46,
        "total_tokens": 117,
        "prompt_tokens_details": {},
    }
    completion = completion_from_wire(body({"content": "x"}, usage=usage, model="gpt-4o"))
    assert completion.usage == Usage(prompt_tokens=71, completion_tokens=46, total_tokens=117)
    assert completion.model == "gpt-4o"


@pytest.mark.parametrize("usage", [None, "n/a", {}, {"prompt_tokens": "lots"}], ids=str)
def test_missing_or_odd_usage(usage: Any) -> None:
    extra = {} if usage is None else {"usage": usage}
    completion = completion_from_wire(body({"content": "x"}, **extra))
    assert completion.usage == Usage()
    assert completion.model == ""


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        # the server's total wins even when it is not prompt + completion (cached tokens...)
        (
            {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 9},
            Usage(prompt_tokens=3, completion_tokens=4, total_tokens=9),
        ),
        (
            {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
            Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0),
        ),
        (
            {"prompt_tokens": -5, "completion_tokens": 2},
            Usage(prompt_tokens=0, completion_tokens=2, total_tokens=2),
        ),  # never negative
        (
            {"prompt_tokens": 2.9, "completion_tokens": "4"},
            Usage(prompt_tokens=2, completion_tokens=4, total_tokens=6),
        ),
        (
            {"prompt_tokens": True, "completion_tokens": 1},
            Usage(prompt_tokens=0, completion_tokens=1, total_tokens=1),
        ),  # not a count
    ],
    ids=["total-kept", "zeros", "negative", "float-and-digits", "bool"],
)
def test_token_counts_are_read_defensively(usage: dict[str, Any], expected: Usage) -> None:
    assert completion_from_wire(body({"content": "x"}, usage=usage)).usage == expected


def test_usage_total_filled_in_when_missing() -> None:
    completion = completion_from_wire(
        body({"content": "x"}, usage={"prompt_tokens": 3, "completion_tokens": 4})
    )
    assert completion.usage.total_tokens == 7


# --- unusable bodies -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ([1, 2], "response is a JSON list, not an object"),
        ("text", "response is a JSON str, not an object"),
        ({"id": "x"}, "response has no choices"),
        ({"choices": []}, "response has no choices"),
        ({"choices": "nope"}, "response has no choices"),
        ({"choices": [{"text": "legacy"}]}, "response has no choices[0].message object"),
        ({"error": {"message": "model overloaded"}}, "response carries an error: model overloaded"),
        ({"choices": [{"message": {"tool_calls": 7}}]}, "tool_calls is a JSON int, not a list"),
    ],
)
def test_unusable_bodies_raise_one_line_response_errors(payload: Any, message: str) -> None:
    with pytest.raises(AgentResponseError) as info:
        completion_from_wire(payload)
    assert str(info.value) == message
    assert "\n" not in str(info.value)
    assert not info.value.retryable


def test_unknown_keys_are_ignored() -> None:
    wire = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "system_fingerprint": "fp_ollama",
        "x_groq": {"id": "req"},
        "timings": {"predicted_ms": 1.0},
        "choices": [
            {
                "index": 0,
                "logprobs": None,
                "finish_reason": "stop",
                "message": {
                    "role": "assistant",
                    "content": "ok",
                    "annotations": [],
                    "refusal": None,
                },
            }
        ],
    }
    completion = completion_from_wire(wire)
    assert (completion.message.content, completion.finish_reason) == ("ok", "stop")


# --- JSON within bounds -----------------------------------------------------------------------


def nested(depth: int) -> str:
    """An object `depth` levels deep: {"a": {"a": ... 1 ...}}."""
    return '{"a":' * depth + "1" + "}" * depth


def depth_of(value: Any) -> int:
    depth = 0
    while isinstance(value, dict | list) and value:
        value = next(iter(value.values())) if isinstance(value, dict) else value[0]
        depth += 1
    return depth


@pytest.mark.parametrize("text", [nested(100_000), "[" * 100_000 + "]" * 100_000])
def test_loads_json_reads_json_of_any_depth_without_recursion_error(text: str) -> None:
    value = loads_json(text)  # json.loads raises RecursionError past ~1,000 levels

    assert 150 < depth_of(value) <= 200  # cut where a reply's arguments are already malformed
    assert loads_json(text.encode()) == value


def test_loads_json_refuses_what_is_not_json_even_when_deep() -> None:
    for text in ["[" * 5_000, "[" * 5_000 + '"never closed', "[" * 5_000 + "}" * 5_000]:
        with pytest.raises(json.JSONDecodeError):
            loads_json(text)


@pytest.mark.parametrize(
    "arguments",
    [nested(5_000), nested(MAX_JSON_DEPTH + 1), json.loads(nested(MAX_JSON_DEPTH + 1))],
    ids=["string, 5,000 deep", "string, one too deep", "object, one too deep"],
)
def test_arguments_nested_too_deep_are_malformed_not_a_crash(arguments: Any) -> None:
    completion = completion_from_wire(body({"tool_calls": [wire_call("f", arguments)]}))

    (call,) = completion.message.tool_calls
    assert call.arguments == {}
    assert call.arguments_error == (
        f"arguments nest objects and arrays deeper than {MAX_JSON_DEPTH} levels"
    )
    assert call.raw_arguments == (arguments if isinstance(arguments, str) else None)


def test_arguments_at_the_depth_limit_are_taken() -> None:
    arguments = nested(MAX_JSON_DEPTH)

    (call,) = completion_from_wire(
        body({"tool_calls": [wire_call("f", arguments)]})
    ).message.tool_calls

    assert call.arguments_error is None
    assert call.arguments == json.loads(arguments)


def test_a_body_nested_too_deep_for_python_gives_a_malformed_call() -> None:
    """Arguments sent as an object (Ollama native, llama.cpp) 5,000 deep: the body itself is
    too deep for json.loads."""
    raw = json.dumps(body({"tool_calls": [wire_call("f", {"x": 1})]})).replace(
        '{"x": 1}', nested(5_000)
    )

    (call,) = completion_from_wire(loads_json(raw)).message.tool_calls

    assert (call.name, call.arguments) == ("f", {})
    assert call.arguments_error == (
        f"arguments nest objects and arrays deeper than {MAX_JSON_DEPTH} levels"
    )


def test_lone_surrogate_escapes_read_as_the_replacement_character() -> None:
    """`"\\ud800"` is valid JSON that decodes to a string UTF-8 cannot encode: the store, the
    terminal and the next request would refuse it."""
    arguments = r'{"\udc00k": "v\ud800"}'  # escapes inside the arguments' own JSON text
    raw = json.dumps(  # ensure_ascii: the content's surrogate goes as an escape, as servers send
        body({"content": "a \ud800 b", "tool_calls": [wire_call("f", arguments)]})
    )

    message = completion_from_wire(loads_json(raw)).message

    assert message.content == "a \ufffd b"
    assert message.tool_calls[0].arguments == {"\ufffdk": "v\ufffd"}
    assert loads_json(r'"\ud83d\ude00"') == "\U0001f600"  # a pair is one character: kept
    assert loads_json(b'"\xed\xa0\x80"') == "\ufffd"  # json.loads takes encoded surrogates too
