"""InMemorySession and History behaviours that mutation testing found unpinned: the error text
of an index past a history's end and of a change to a stored call's arguments, a history's
repr, and that a call stored already frozen is kept as it is rather than copied again."""

from __future__ import annotations

import pytest

from fsm_kernel.protocol import Message, ToolCall
from fsm_kernel.session import FrozenDict, History, InMemorySession


def test_an_index_past_either_end_of_a_history_says_it_is_out_of_range() -> None:
    history = InMemorySession(messages=[Message.user("a")]).history((Message.system("s"),))
    for index in (2, -3):
        with pytest.raises(IndexError) as caught:
            history[index]
        assert str(caught.value) == "history index out of range"


def test_changing_a_stored_calls_arguments_is_refused_naming_what_refused() -> None:
    call = ToolCall(id="c1", name="search", arguments={"query": "x", "tags": ["a"]})
    session = InMemorySession(messages=[Message.assistant(tool_calls=[call])])
    [stored] = session.messages()[0].tool_calls

    with pytest.raises(TypeError) as on_dict:
        stored.arguments["query"] = "y"
    with pytest.raises(TypeError) as on_list:
        stored.arguments["tags"].append("b")

    assert str(on_dict.value) == "a stored tool call's arguments cannot be changed (FrozenDict)"
    assert str(on_list.value) == "a stored tool call's arguments cannot be changed (FrozenList)"
    assert stored.arguments == {"query": "x", "tags": ["a"]}


def test_a_history_shows_its_messages_in_its_repr() -> None:
    history = InMemorySession(messages=[Message.user("a")]).history((Message.system("s"),))
    assert repr(history) == f"History({[Message.system('s'), Message.user('a')]!r})"
    assert repr(History((), [Message.user("a"), Message.user("b")], 1)) == (
        f"History({[Message.user('a')]!r})"
    )


def test_a_call_stored_already_frozen_is_kept_while_its_neighbour_is_frozen() -> None:
    """Adding copies only the arguments that are not frozen yet: a call read from a session
    (frozen) is stored as it is, beside a new call whose arguments are frozen copies."""
    frozen = ToolCall(id="c1", name="search", arguments=FrozenDict({"query": "x"}))
    plain = ToolCall(id="c2", name="fetch", arguments={"url": "u"})
    session = InMemorySession()

    session.add(Message.assistant(tool_calls=[frozen, plain]))

    kept, copied = session.messages()[0].tool_calls
    assert kept is frozen
    assert copied is not plain
    assert type(copied.arguments) is FrozenDict
    assert copied.arguments == {"url": "u"}
