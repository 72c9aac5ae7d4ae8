"""InMemorySession: ids, round trips, ordering, defensive copies, clearing, thread safety."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
import re
import threading
from collections.abc import Callable
from typing import Any

import pytest

from fsm_kernel.protocol import Message, Role, ToolCall, ToolResult
from fsm_kernel.session import InMemorySession, Session

UUID7 = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def numbered(n: int) -> Message:
    return Message.user(f"message {n}")


def test_new_session_has_a_uuid7_id_and_no_messages() -> None:
    session = InMemorySession()
    assert UUID7.match(session.id)
    assert session.messages() == []
    assert len(session) == 0
    assert isinstance(session, Session)


def test_ids_are_unique() -> None:
    assert len({InMemorySession().id for _ in range(50)}) == 50


def test_id_is_stable_and_can_be_given() -> None:
    session = InMemorySession()
    assert session.id == session.id
    session.add(numbered(1))
    session.clear()
    first = session.id
    assert session.id == first
    assert InMemorySession("run-42").id == "run-42"


def test_initial_messages_are_copied() -> None:
    initial = [numbered(1), numbered(2)]
    session = InMemorySession(messages=initial)
    initial.append(numbered(3))
    assert session.messages() == [numbered(1), numbered(2)]


def test_round_trip_keeps_every_field() -> None:
    call = ToolCall(
        id="call_9",
        name="search",
        arguments={"q": "x"},
        raw_arguments='{"q": x}',
        arguments_error="bad json",
    )
    message = Message(
        role=Role.ASSISTANT,
        content="thinking done",
        tool_calls=(call,),
        tool_call_id="call_8",
        name="search",
        reasoning="because",
    )
    session = InMemorySession()
    session.add(message)
    [stored] = session.messages()
    assert stored == message
    for f in dataclasses.fields(Message):
        assert getattr(stored, f.name) == getattr(message, f.name)


def test_messages_come_back_in_insertion_order() -> None:
    session = InMemorySession()
    for n in range(10):
        session.add(numbered(n))
    session.extend(numbered(n) for n in range(10, 15))
    assert [m.content for m in session.messages()] == [f"message {n}" for n in range(15)]
    assert len(session) == 15


@pytest.mark.parametrize("role", list(Role))
def test_each_role_is_stored(role: Role) -> None:
    session = InMemorySession()
    session.add(Message(role=role, content=f"a {role.value} message"))
    [stored] = session.messages()
    assert stored.role is role
    assert stored.content == f"a {role.value} message"


def test_tool_calls_and_tool_results() -> None:
    calls = [
        ToolCall(id="call_1", name="read_file", arguments={"path": "a.txt"}),
        ToolCall(id="call_2", name="datetime"),
    ]
    session = InMemorySession()
    session.add(Message.user("read a.txt and tell the time"))
    session.add(Message.assistant(tool_calls=calls))
    session.add(Message.tool(calls[0], ToolResult(content="contents")))
    session.add(Message.tool(calls[1], ToolResult(content="now", is_error=False)))
    stored = session.messages()
    assert [m.role for m in stored] == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.TOOL]
    assert stored[1].tool_calls == tuple(calls)
    assert [(m.tool_call_id, m.name, m.content) for m in stored[2:]] == [
        ("call_1", "read_file", "contents"),
        ("call_2", "datetime", "now"),
    ]


def test_mutating_the_returned_list_does_not_change_the_session() -> None:
    session = InMemorySession()
    session.add(numbered(1))
    returned = session.messages()
    returned.append(numbered(2))
    returned[0] = numbered(99)
    returned.clear()
    assert session.messages() == [numbered(1)]
    assert session.messages() is not session.messages()


def test_returned_tool_calls_cannot_be_mutated() -> None:
    session = InMemorySession()
    session.add(Message.assistant(tool_calls=[ToolCall(id="c", name="t")]))
    [stored] = session.messages()
    assert isinstance(stored.tool_calls, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stored.tool_calls = ()  # type: ignore[misc]  # the point of the test
    with pytest.raises(dataclasses.FrozenInstanceError):
        stored.tool_calls[0].name = "other"  # type: ignore[misc]
    assert session.messages()[0].tool_calls == (ToolCall(id="c", name="t"),)


def test_tool_call_arguments_are_copied_in_and_frozen_out() -> None:
    arguments: dict[str, Any] = {"path": "a.txt", "options": {"lines": [1, 2]}}
    session = InMemorySession()
    session.add(Message.assistant(tool_calls=[ToolCall(id="c", name="t", arguments=arguments)]))
    arguments["path"] = "changed-by-caller"
    arguments["options"]["lines"].append(3)
    [stored] = session.messages()
    stored_args = stored.tool_calls[0].arguments
    changes: list[Callable[[], object]] = [
        lambda: stored_args.__setitem__("path", "changed-by-reader"),
        lambda: stored_args.update(path="x"),
        lambda: stored_args.pop("path"),
        lambda: stored_args.clear(),
        lambda: stored_args.setdefault("new", 1),
        lambda: stored_args.__delitem__("path"),
        lambda: stored_args["options"].__setitem__("lines", []),
        lambda: stored_args["options"]["lines"].append(3),
        lambda: stored_args["options"]["lines"].__setitem__(0, 9),
        lambda: stored_args["options"]["lines"].extend([3]),
        lambda: stored_args["options"]["lines"].sort(),
    ]
    for change in changes:
        with pytest.raises(TypeError, match="cannot be changed"):
            change()
    assert session.messages()[0].tool_calls[0].arguments == {
        "path": "a.txt",
        "options": {"lines": [1, 2]},
    }


def test_frozen_arguments_behave_as_plain_json_values() -> None:
    session = InMemorySession()
    arguments = {"q": "x", "n": [1, {"k": None}], "t": (1, 2)}
    session.add(Message.assistant(tool_calls=[ToolCall(id="c", name="t", arguments=arguments)]))
    stored = session.messages()[0].tool_calls[0].arguments
    assert isinstance(stored, dict)
    assert stored == arguments
    assert json.dumps(stored, sort_keys=True) == json.dumps(arguments, sort_keys=True)
    assert copy.deepcopy(stored) == stored
    assert pickle.loads(pickle.dumps(stored)) == stored
    plain = dict(stored)
    plain["q"] = "y"  # a copy is the caller's to change
    assert stored["q"] == "x"
    assert ToolCall.from_dict(session.messages()[0].tool_calls[0].to_dict()).arguments == stored


def test_reading_shares_the_stored_messages_instead_of_copying_them() -> None:
    session = InMemorySession()
    session.add(Message.assistant(tool_calls=[ToolCall(id="c", name="t", arguments={"a": 1})]))
    first, second = session.messages(), session.messages()
    assert first is not second
    assert first[0] is second[0]
    again = InMemorySession(messages=first)  # frozen calls are not copied again
    assert again.messages()[0] is first[0]


def test_clear_empties_the_session() -> None:
    session = InMemorySession()
    session.extend([numbered(1), numbered(2)])
    session.clear()
    assert session.messages() == []
    assert len(session) == 0


def test_add_after_clear() -> None:
    session = InMemorySession()
    session.extend([numbered(1), numbered(2)])
    session.clear()
    session.add(numbered(3))
    assert session.messages() == [numbered(3)]


def _run_threads(targets: list[threading.Thread]) -> None:
    for t in targets:
        t.start()
    for t in targets:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in targets)


def test_concurrent_adds_keep_every_message() -> None:
    session = InMemorySession()
    barrier = threading.Barrier(100)

    def add(n: int) -> None:
        barrier.wait()
        for k in range(20):
            session.add(Message.user(f"{n}-{k}"))

    _run_threads([threading.Thread(target=add, args=(n,)) for n in range(100)])
    contents = [m.content for m in session.messages()]
    assert len(contents) == 2000
    assert set(contents) == {f"{n}-{k}" for n in range(100) for k in range(20)}
    for n in range(100):  # each thread's own messages stay in its order
        mine = [c for c in contents if c.startswith(f"{n}-")]
        assert mine == [f"{n}-{k}" for k in range(20)]


def test_concurrent_add_and_read() -> None:
    session = InMemorySession()
    errors: list[BaseException] = []
    seen_lengths: list[int] = []

    def writer() -> None:
        for k in range(500):
            session.add(numbered(k))

    def reader() -> None:
        try:
            last = 0
            for _ in range(200):
                snapshot = session.messages()
                # A snapshot is always a prefix of the final history: never shorter than before.
                assert len(snapshot) >= last
                assert [m.content for m in snapshot] == [
                    f"message {k}" for k in range(len(snapshot))
                ]
                last = len(snapshot)
            seen_lengths.append(last)
        except BaseException as exc:  # collected and re-raised in the main thread
            errors.append(exc)
            raise

    _run_threads(
        [threading.Thread(target=writer)] + [threading.Thread(target=reader) for _ in range(4)]
    )
    assert errors == []
    assert len(seen_lengths) == 4
    assert len(session) == 500


def test_concurrent_add_and_clear() -> None:
    session = InMemorySession()
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            for k in range(200):
                session.add(Message.user(f"{n}-{k}"))
                session.extend([Message.user(f"{n}-{k}-x")])
        except BaseException as exc:
            errors.append(exc)
            raise

    def clearer() -> None:
        try:
            for _ in range(200):
                session.clear()
                len(session)
        except BaseException as exc:
            errors.append(exc)
            raise

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    threads.append(threading.Thread(target=clearer))
    _run_threads(threads)
    assert errors == []
    remaining = session.messages()
    assert len(remaining) == len(session) <= 1600
    session.clear()
    session.add(numbered(1))
    assert session.messages() == [numbered(1)]


# --- history(): the snapshot the kernel hands the model -------------------------------------


def test_history_reads_like_a_tuple_of_head_then_messages() -> None:
    system = Message.system("be brief")
    session = InMemorySession(messages=[Message.user("a"), Message.assistant("b")])
    history = session.history((system,))
    expected = [system, Message.user("a"), Message.assistant("b")]
    assert len(history) == 3
    assert list(history) == expected
    assert history == expected
    assert history == tuple(expected)
    assert history != expected[:2]
    assert history != [*expected[:2], Message.user("other")]
    assert history[0] is system
    assert history[1] == Message.user("a")
    assert history[-1] == Message.assistant("b")
    assert history[-3] is system
    assert history[1:] == expected[1:]
    assert history[::-1] == expected[::-1]
    assert history.index(Message.assistant("b")) == 2
    assert Message.user("a") in history
    with pytest.raises(IndexError):
        history[3]
    with pytest.raises(IndexError):
        history[-4]
    assert session.history() == expected[1:]
    assert (history == "not a sequence") is False


def test_history_is_a_snapshot_that_later_changes_leave_alone() -> None:
    session = InMemorySession(messages=[Message.user("first")])
    before = session.history()
    session.add(Message.assistant("second"))
    session.extend([Message.user("third")])
    assert list(before) == [Message.user("first")]
    assert len(session.history()) == 3
    session.clear()
    session.add(Message.user("after clear"))
    assert list(before) == [Message.user("first")]  # clear does not empty it in place
    assert list(session.history()) == [Message.user("after clear")]


def test_history_shares_the_stored_messages() -> None:
    session = InMemorySession(messages=[Message.user("a")])
    assert session.history()[0] is session.messages()[0]


def test_history_is_not_hashable_like_the_lists_it_equals() -> None:
    with pytest.raises(TypeError):
        hash(InMemorySession().history())


class _Newest(InMemorySession):
    """A session that reads its history its own way: only the newest message."""

    def messages(self) -> list[Message]:
        return super().messages()[-1:]


def test_the_model_request_is_the_system_prompt_then_the_history() -> None:
    from fsm_kernel.workflow.context import RunContext

    ctx = RunContext(system_prompt="sys")
    ctx.session.extend([Message.user("a"), Message.assistant("b")])
    request = ctx.messages_for_model()
    assert request == [Message.system("sys"), Message.user("a"), Message.assistant("b")]
    ctx.session.add(Message.user("c"))
    assert len(request) == 3  # a snapshot
    assert ctx.messages_for_model()[-1] == Message.user("c")
    assert RunContext(
        session=InMemorySession(messages=[Message.user("a")])
    ).messages_for_model() == [Message.user("a")]  # no system prompt, no head


def test_a_session_subclass_reading_its_own_way_is_asked_for_its_messages() -> None:
    from fsm_kernel.workflow.context import RunContext

    session = _Newest(messages=[Message.user("old"), Message.user("new")])
    request = RunContext(system_prompt="sys", session=session).messages_for_model()
    assert request == [Message.system("sys"), Message.user("new")]


def test_a_history_ends_where_it_was_taken_however_the_session_grew() -> None:
    session = InMemorySession(messages=[Message.user("a")])
    history = session.history((Message.system("s"),))
    session.extend([Message.user("b"), Message.user("c")])
    assert len(history) == 2
    with pytest.raises(IndexError):
        history[2]  # "b" is in the list it reads, but came after
    assert history[-1] == Message.user("a")


def test_a_history_leaves_other_comparisons_to_the_other_side() -> None:
    from unittest import mock

    assert InMemorySession().history() == mock.ANY  # NotImplemented, not False
