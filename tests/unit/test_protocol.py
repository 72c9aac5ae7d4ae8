"""Core data types: to_dict/from_dict round trips (through real JSON), helpers, the stored event
schema, and new_id() as a UUIDv7."""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from fsm_kernel import protocol
from fsm_kernel.protocol import (
    ChatModel,
    Clock,
    Completion,
    Event,
    EventType,
    Message,
    Role,
    RunSummary,
    SystemClock,
    Tool,
    ToolCall,
    ToolResult,
    Usage,
    new_id,
)


def _json(d: dict[str, Any]) -> dict[str, Any]:
    """Through real JSON, as the event log stores it."""
    out: dict[str, Any] = json.loads(json.dumps(d))
    return out


CALL = ToolCall(id="c1", name="read_file", arguments={"path": "a.txt", "n": 2})
BAD_CALL = ToolCall(
    id="c2", name="datetime", raw_arguments='{"tz": ', arguments_error="Expecting value"
)


@pytest.mark.parametrize("call", [CALL, BAD_CALL, ToolCall(id="c3", name="done")])
def test_tool_call_round_trip(call: ToolCall) -> None:
    assert ToolCall.from_dict(_json(call.to_dict())) == call


def test_tool_call_dict_omits_absent_fields() -> None:
    assert CALL.to_dict() == {
        "id": "c1",
        "name": "read_file",
        "arguments": {"path": "a.txt", "n": 2},
    }
    assert BAD_CALL.to_dict()["raw_arguments"] == '{"tz": '


def test_arguments_json_is_canonical_or_the_raw_text() -> None:
    a = ToolCall(id="x", name="t", arguments={"b": 1, "a": "é"})
    b = ToolCall(id="y", name="t", arguments={"a": "é", "b": 1})

    assert a.arguments_json() == b.arguments_json() == '{"a": "é", "b": 1}'
    assert BAD_CALL.arguments_json() == '{"tz": '


def test_arguments_nested_past_the_limit_make_a_malformed_call_whoever_built_it() -> None:
    def nested(depth: int) -> dict[str, Any]:
        value: Any = 1
        for _ in range(depth - 1):
            value = [value] if _ % 2 else {"a": value}
        return {"a": value}

    at_limit = ToolCall(id="c1", name="f", arguments=nested(protocol.MAX_JSON_DEPTH))
    too_deep = ToolCall(id="c2", name="f", arguments=nested(protocol.MAX_JSON_DEPTH + 1))
    very_deep = ToolCall(id="c3", name="f", arguments=nested(50_000))  # no RecursionError

    assert at_limit.arguments_error is None
    assert at_limit.arguments == nested(protocol.MAX_JSON_DEPTH)
    for call in (too_deep, very_deep):
        assert (call.arguments, call.arguments_error) == ({}, protocol.TOO_DEEP)
        assert ToolCall.from_dict(call.to_dict()) == call


@pytest.mark.parametrize(
    "message",
    [
        Message.system("be brief"),
        Message.user("hi"),
        Message.assistant("", [CALL, BAD_CALL]),
        Message(role=Role.ASSISTANT, content="42", reasoning="thought hard"),
        Message.tool(CALL, ToolResult(content="alpha")),
    ],
    ids=["system", "user", "calls", "reasoning", "tool"],
)
def test_message_round_trip(message: Message) -> None:
    assert Message.from_dict(_json(message.to_dict())) == message


def test_message_helpers() -> None:
    tool_msg = Message.tool(CALL, ToolResult(content="boom", is_error=True))

    assert tool_msg.role == Role.TOOL
    assert (tool_msg.tool_call_id, tool_msg.name, tool_msg.content) == ("c1", "read_file", "boom")
    assert Message.user("x").to_dict() == {"role": "user", "content": "x"}
    assert Message.from_dict({"role": "assistant", "content": None}).content == ""


def test_tool_result_round_trip() -> None:
    full = ToolResult(
        content="x", is_error=True, error_type="ToolFatalError", fatal=True, truncated=True
    )
    plain = ToolResult(content="ok")

    assert ToolResult.from_dict(_json(full.to_dict())) == full
    assert ToolResult.from_dict(_json(plain.to_dict())) == plain
    assert plain.to_dict() == {"content": "ok", "is_error": False}


def test_usage_adds_and_round_trips() -> None:
    a = Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3)
    b = Usage(prompt_tokens=10, completion_tokens=20, total_tokens=30)

    assert a + b == Usage(prompt_tokens=11, completion_tokens=22, total_tokens=33)
    assert Usage.from_dict(_json(a.to_dict())) == a
    assert Usage.from_dict(None) == Usage()
    assert Usage.from_dict({"prompt_tokens": None, "total_tokens": "4"}) == Usage(total_tokens=4)


def test_completion_round_trip() -> None:
    c = Completion(
        message=Message.assistant("", [CALL]),
        finish_reason="tool_calls",
        usage=Usage(prompt_tokens=5, completion_tokens=1, total_tokens=6),
        model="qwen3",
    )

    assert Completion.from_dict(_json(c.to_dict())) == c


def test_tool_to_dict() -> None:
    t = Tool(name="datetime")

    assert t.to_dict() == {
        "name": "datetime",
        "description": "",
        "parameters": {"type": "object", "properties": {}},
    }


def test_event_round_trip_keeps_an_aware_timestamp() -> None:
    ts = datetime(2025, 3, 1, 12, 30, 15, 123456, tzinfo=UTC)
    e = Event(
        run_id="r1",
        seq=7,
        type=EventType.TOOL_FINISHED,
        timestamp=ts,
        iteration=2,
        state="act",
        data={"call": CALL.to_dict(), "result": {"content": "x", "is_error": False}},
    )

    d = _json(e.to_dict())
    back = Event.from_dict(d)

    assert back == e
    assert d["type"] == "tool.finished"
    assert d["v"] == 1
    assert back.timestamp.utcoffset() == timedelta(0)
    assert e.with_seq(9).seq == 9
    assert e.with_seq(9).data == e.data


def test_event_from_another_offset_is_the_same_instant() -> None:
    paris = datetime(2025, 3, 1, 13, 30, tzinfo=timezone(timedelta(hours=1)))
    e = Event(run_id="r", seq=1, type=EventType.RUN_STARTED, timestamp=paris)

    assert Event.from_dict(_json(e.to_dict())).timestamp == datetime(2025, 3, 1, 12, 30, tzinfo=UTC)


def test_event_types_are_a_stored_schema() -> None:
    assert [t.value for t in EventType] == [
        "run.started",
        "run.resumed",
        "state.entered",
        "message.added",
        "transition.taken",
        "model.requested",
        "model.responded",
        "model.failed",
        "model.notice",
        "tool.started",
        "tool.finished",
        "iteration.completed",
        "human.answered",
        "run.suspended",
        "run.terminated",
        "action.failed",
        "vars.assigned",
        "error.caught",
        "context.trimmed",
        "child.started",
        "child.finished",
        "notify.attempted",
        "timer.set",
        "timer.fired",
        "timer.cancelled",
        "event.delivered",
    ]


def test_run_summary_to_dict() -> None:
    started = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
    s = RunSummary(run_id="r", workflow="default", started_at=started, goal="g", iterations=2)

    assert _json(s.to_dict()) == {
        "run_id": "r",
        "workflow": "default",
        "started_at": "2025-01-02T03:04:05+00:00",
        "goal": "g",
        "iterations": 2,
        "status": "running",
        "termination_reason": None,
        "tokens": 0,
        "updated_at": None,
        "parent_run_id": None,
    }


def test_protocols_are_runtime_checkable() -> None:
    class Echo:
        async def complete(self, messages: Sequence[Message], tools: Sequence[Tool]) -> Completion:
            return Completion(message=Message.assistant(messages[-1].content))

    assert isinstance(Echo(), ChatModel)
    assert isinstance(SystemClock(), Clock)
    assert not isinstance(object(), ChatModel)


def test_system_clock_is_aware_utc() -> None:
    now = SystemClock().now()

    assert now.tzinfo is not None
    assert now.utcoffset() == timedelta(0)


# --- new_id -----------------------------------------------------------------------------------


def test_new_id_is_a_uuid_version_7() -> None:
    for _ in range(200):
        value = uuid.UUID(new_id())
        assert value.version == 7
        assert value.variant == uuid.RFC_4122


def test_new_id_format() -> None:
    text = new_id()

    assert len(text) == 36
    assert [len(p) for p in text.split("-")] == [8, 4, 4, 4, 12]
    assert text == text.lower()
    assert text[14] == "7"
    assert text[19] in "89ab"


def test_new_id_carries_the_millisecond_timestamp() -> None:
    before = time.time_ns() // 1_000_000
    value = uuid.UUID(new_id())
    after = time.time_ns() // 1_000_000

    assert before <= value.int >> 80 <= after


def test_new_ids_are_unique() -> None:
    ids = [new_id() for _ in range(5000)]

    assert len(set(ids)) == len(ids)


def test_new_ids_sort_by_creation_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # One id per millisecond (a fake clock): within one millisecond the order is random.
    ms = itertools.count(1_700_000_000_000)
    monkeypatch.setattr(protocol.time, "time_ns", lambda: next(ms) * 1_000_000)

    ids = [new_id() for _ in range(50)]

    assert sorted(ids) == ids
    stamps = [uuid.UUID(i).int >> 80 for i in ids]
    assert stamps == sorted(set(stamps))
    assert stamps[0] >= 1_700_000_000_000
